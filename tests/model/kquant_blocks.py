"""GGUF blocks of Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4 for tests: random valid blocks (kernel
tests) and a round-to-nearest quantizer for the K-quants, IQ4_NL and IQ4_XS (the gguf package has none; a
requantized model needs blocks near its weights, not optimal ones). Layouts: kvpilot/model/quant/formats.py's docstring.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from kvpilot.model.quant.formats import IQ4_NL_VALUES

# byte offsets of each block's float16 fields
_HALF_FIELDS = {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0],
                "IQ4_XS": [0], "MXFP4": []}
# MXFP4 exponent bytes of random blocks: scales 2^-24 .. 2^7 (float16 holds them: the int8 tiles take them)
MXFP4_TILED_EXPONENTS = (104, 136)


def random_blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, cols / block_values * block_bytes]: random bytes with finite, varied float16 scales (some
    negative, some subnormal), i.e. valid blocks of every quant and sub-scale value; MXFP4 exponents in
    MXFP4_TILED_EXPONENTS."""
    rng = np.random.default_rng(seed)
    values, block_bytes = GGML_QUANT_SIZES[T[name]]
    raw = rng.integers(0, 256, size=(rows, cols // values, block_bytes), dtype=np.uint8)
    if name == "MXFP4":
        raw[:, :, 0] = rng.integers(*MXFP4_TILED_EXPONENTS, size=(rows, cols // values), dtype=np.uint8)
    for offset in _HALF_FIELDS[name]:
        scales = rng.uniform(-0.05, 0.05, size=(rows, cols // values)).astype(np.float16)
        scales.flat[::97] = np.float16(3e-6)  # a subnormal float16
        raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def _round_scales(scales: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per super-block float scales [n, s] >= 0 -> (d float16 [n], integer scales [n, s] in 0..levels)."""
    d = (scales.max(axis=-1) / levels).astype(np.float16)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d32[:, None] > 0, np.rint(scales / d32[:, None]), 0)
    return d, np.clip(q, 0, levels).astype(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and minimums [n, 8] each -> GGUF's 12 bytes (k_scales_and_mins inverts it)."""
    low = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    mid = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([low, mid, high], axis=-1).astype(np.uint8)


def _quantize_qk(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) / Q5_K (bits 5) of super-blocks x [n, 256]."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    top = (1 << bits) - 1
    lo = np.minimum(sub.min(axis=-1), 0)
    d, sc = _round_scales((sub.max(axis=-1) - lo) / top, 63)
    dmin, mn = _round_scales(-lo, 63)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((sub + offset[..., None]) / step[..., None]), 0)
    q = np.clip(q, 0, top).astype(np.uint8)  # [n, 8, 32]
    nibbles = (q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)  # [n, 4, 32]: sub-blocks 2c, 2c + 1
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), _pack_k_scales(sc, mn)]
    if bits == 5:
        high = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
        parts.append(high.sum(axis=1, dtype=np.uint8))  # [n, 32]: bit j of byte l = sub-block j's value l
    return np.concatenate([*parts, nibbles.reshape(n, 128)], axis=-1)


def _quantize_q6k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    amax = np.abs(sub).max(axis=-1)
    d = (amax.max(axis=-1) / 32 / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(amax / 32 / d32), -128, 127), 0).astype(np.int8)
        step = (d32 * sc)[..., None]
        q = np.where(step != 0, np.rint(sub / step), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)  # values v = 128 h + w
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)  # [n, 2, 64]
    high = (q >> 4).reshape(n, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = high.sum(axis=2, dtype=np.uint8)  # [n, 2, 32]
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)],
                          axis=-1)


def _quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """IQ4_NL of blocks x [n, 32]: d from the block's largest magnitude (its sign: the table reaches -127, only
    113 up), each value the nearest table entry."""
    table = np.array(IQ4_NL_VALUES, dtype=np.float32)
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[:, None], axis=-1)  # [n, 1], signed
    d = (-peak / 127).astype(np.float16)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(d32 != 0, x / d32, 0)
    q = np.abs(scaled[..., None] - table).argmin(axis=-1).astype(np.uint8)  # [n, 32]
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), q[:, :16] | (q[:, 16:] << 4)], axis=-1)


def _quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """IQ4_XS of super-blocks x [n, 256]: each sub-block of 32 scaled as IQ4_NL would (its peak to the table's -127),
    that scale rounded to d * (ls - 32) with d float16 a super-block and ls 6 bits, values the nearest entries."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    table = np.array(IQ4_NL_VALUES, dtype=np.float32)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(axis=-1)[..., None], axis=-1)[..., 0]  # [n, 8], signed
    ideal = -peak / 127
    d = (np.abs(ideal).max(axis=-1) / 32).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = (np.where(d32 != 0, np.clip(np.rint(ideal / d32), -32, 31), 0) + 32).astype(np.uint16)  # [n, 8]
        dl = (d32 * (ls.astype(np.float32) - 32))[..., None]
        scaled = np.where(dl != 0, sub / dl, 0)
    q = np.abs(scaled[..., None] - table).argmin(axis=-1).astype(np.uint8)  # [n, 8, 32]
    scales_h = (((ls >> 4) & 3) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16)
    scales_l = ((ls[:, 0::2] & 0x0F) | ((ls[:, 1::2] & 0x0F) << 4)).astype(np.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), scales_h.astype("<u2").view(np.uint8).reshape(n, 2),
                           scales_l, qs], axis=-1)


def quantize_blocks(values: np.ndarray, name: str) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, blocks * block_bytes] of GGUF type `name` (round to nearest for the
    K-quants, IQ4_NL and IQ4_XS; the gguf package's quantizer for the others)."""
    if name == "IQ4_NL":
        return _quantize_iq4_nl(np.ascontiguousarray(values, dtype=np.float32).reshape(-1, 32)).reshape(
            values.shape[0], -1)
    if name not in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS"):
        return quantize(values, T[name])
    rows = values.shape[0]
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, 256)
    if name == "IQ4_XS":
        raw = _quantize_iq4_xs(x)
    else:
        raw = _quantize_q6k(x) if name == "Q6_K" else _quantize_qk(x, 4 if name == "Q4_K" else 5)
    return raw.reshape(rows, -1)
