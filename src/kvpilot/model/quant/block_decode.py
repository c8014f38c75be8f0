"""GGUF blocks of the formats kept as blocks (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4, IQ4_XS) decoded into
integers, at load: each 32-value block's unsigned quants and the scales that turn them into values
(quant/tiled_kquant.py lays them out for the int8 kernel).

Invariant: for every format, value = s * q + o per 32-value block (per 16-value half for Q6_K) with
  Q5_0: s = d, o = -16 d;   Q5_1: s = d, o = m;   Q4_K / Q5_K: s = d * sc, o = -dmin * mn (sub-block = block);
  Q6_K: s = d * sc[half], o = -32 s;   IQ4_NL / MXFP4: s = d, o = -128 d, q = table[index] + 128 (the kernel looks
  the table up; the decoded q are the 4-bit indices, MXFP4's d = 2^(e - 128) as float16);   IQ4_XS: as IQ4_NL
  with s = d * (ls - 32) per 32-value sub-block (d per super-block; ls - 32 kept as an int8 byte)
reproduces the gguf package's float32 dequantization exactly (the products are exact in float32).
The block layouts are GGUF's (formats.py's docstring; the gguf package's quants.py reads them the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpilot.model.quant.formats import (IQ4_NL_VALUES, IQ4_XS, MXFP4, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, TABLE_VALUES,
                                          QuantFormat)

# MXFP4 exponents whose scale 2^(e - 128) float16 holds exactly (2^-24 .. 2^15)
MXFP4_HALF_EXPONENTS = range(104, 144)


@dataclass(frozen=True)
class DecodedBlocks:
    """q: uint8 [N, KB, 32] (0..15, 0..31 or 0..63); d: float16 [N, groups, c] (Q5_0: d per block; Q5_1: d, m
    per block; Q4_K / Q5_K: d, dmin per super-block; Q6_K, IQ4_XS: d per super-block); sub: uint8 [N, KB, 2]
    (Q4_K / Q5_K: the block's 6-bit scale and minimum; Q6_K: its halves' int8 scales, as bytes), [N, KB, 1]
    (IQ4_XS: ls - 32, an int8 as a byte) or None."""

    q: np.ndarray
    d: np.ndarray
    sub: np.ndarray | None


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)


def _nibbles_then_highs(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block (value j low nibble of byte j, value 16 + j high nibble) -> [..., 32] values 0..15."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _decode_q5(blocks: np.ndarray, has_min: bool) -> DecodedBlocks:
    start = 4 if has_min else 2
    qh = np.ascontiguousarray(blocks[..., start:start + 4]).view("<u4")  # [N, KB, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = _nibbles_then_highs(blocks[..., start + 4:start + 20]) | (high << 4)
    d = np.concatenate([_half(blocks, 0), _half(blocks, 2)], axis=-1) if has_min else _half(blocks, 0)
    return DecodedBlocks(q, d, None)


def k_scales_and_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 packed bytes [..., 12] -> 6-bit scales and minimums [..., 8] each."""
    low, mid, high = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def _decode_qk(blocks: np.ndarray, five_bits: bool) -> DecodedBlocks:
    n, sb = blocks.shape[:2]
    sc, mn = k_scales_and_mins(blocks[..., 4:16])
    qs = blocks[..., 48:176] if five_bits else blocks[..., 16:144]
    q = np.stack([qs.reshape(n, sb, 4, 32) & 0x0F, qs.reshape(n, sb, 4, 32) >> 4], axis=3)  # [n, sb, chunk, nib, 32]
    q = q.reshape(n, sb, 8, 32)
    if five_bits:
        qh = blocks[..., 16:48]  # bit j of byte l: value l of sub-block j
        q = q | ((((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1)) << 4).astype(np.uint8)
    d = np.concatenate([_half(blocks, 0), _half(blocks, 2)], axis=-1)
    return DecodedBlocks(q.reshape(n, sb * 8, 32), d, np.stack([sc, mn], axis=-1).reshape(n, sb * 8, 2))


def tiles_exactly(raw: np.ndarray, fmt: QuantFormat) -> bool:
    """Whether the int8 tiles hold the values of raw (uint8 blocks of `fmt`) exactly: always, but for MXFP4 blocks
    whose scale float16 lacks (an exponent outside MXFP4_HALF_EXPONENTS)."""
    if fmt != MXFP4:
        return True
    exponents = np.ascontiguousarray(raw).reshape(-1, MXFP4.block_bytes)[:, 0]
    return bool(exponents.size == 0 or (exponents.min() >= MXFP4_HALF_EXPONENTS.start
                                        and exponents.max() < MXFP4_HALF_EXPONENTS.stop))


def _decode_table(blocks: np.ndarray, mxfp4: bool) -> DecodedBlocks:
    """IQ4_NL / MXFP4: the 4-bit indices, and d as float16 (MXFP4: ValueError unless tiles_exactly)."""
    if not mxfp4:
        return DecodedBlocks(_nibbles_then_highs(blocks[..., 2:18]), _half(blocks, 0), None)
    if not tiles_exactly(blocks, MXFP4):
        raise ValueError("MXFP4 scales outside 2^-24 .. 2^15 have no exact float16: keep the float32 kernel")
    power = blocks[..., :1].astype(np.float32) - 128
    return DecodedBlocks(_nibbles_then_highs(blocks[..., 1:17]), np.exp2(power).astype(np.float16), None)


def _decode_iq4xs(blocks: np.ndarray) -> DecodedBlocks:
    """IQ4_XS [d][scales_h u16][scales_l 4 bytes][8 x 16 index bytes]: the indices, d, and ls - 32 per sub-block."""
    n, sb = blocks.shape[:2]
    j = np.arange(8)
    high = np.ascontiguousarray(blocks[..., 2:4]).view("<u2")  # [n, sb, 1]: 2 bits a sub-block
    low = (blocks[..., 4 + j // 2] >> (4 * (j % 2)).astype(np.uint8)) & 0x0F  # [n, sb, 8]
    ls = low.astype(np.int16) | (((high >> (2 * j).astype(np.uint16)) & 3) << 4).astype(np.int16)
    sub = (ls - 32).astype(np.int8).view(np.uint8).reshape(n, sb * 8, 1)
    q = _nibbles_then_highs(blocks[..., 8:136].reshape(n, sb, 8, 16))
    return DecodedBlocks(q.reshape(n, sb * 8, 32), _half(blocks, 0), sub)


def _decode_q6k(blocks: np.ndarray) -> DecodedBlocks:
    n, sb = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(n, sb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    qh = blocks[..., 128:192].reshape(n, sb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    q = ((ql & 0x0F).reshape(n, sb, 256) | ((qh & 0x03).reshape(n, sb, 256) << 4)).astype(np.uint8)
    return DecodedBlocks(q.reshape(n, sb * 8, 32), _half(blocks, 208), blocks[..., 192:208].reshape(n, sb * 8, 2))


def decode_blocks(raw: np.ndarray, fmt: QuantFormat) -> DecodedBlocks:
    """raw uint8 [N, blocks * block_bytes] (a PackedWeight's qs) -> its quants and scales."""
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, fmt.block_bytes)
    if fmt in (Q5_0, Q5_1):
        return _decode_q5(blocks, fmt == Q5_1)
    if fmt in (Q4_K, Q5_K):
        return _decode_qk(blocks, fmt == Q5_K)
    if fmt == Q6_K:
        return _decode_q6k(blocks)
    if fmt.name in TABLE_VALUES:
        return _decode_table(blocks, fmt == MXFP4)
    if fmt == IQ4_XS:
        return _decode_iq4xs(blocks)
    raise ValueError(f"{fmt.name} is not kept as GGUF blocks")


def decoded_values(blocks: DecodedBlocks, fmt: QuantFormat) -> np.ndarray:
    """float32 [N, K]: the values the decoded blocks hold (by the invariant's formula; for tests)."""
    n, kb, _ = blocks.q.shape
    q = blocks.q.astype(np.float32)
    d = blocks.d.astype(np.float32)
    if fmt.name in TABLE_VALUES:
        table = np.asarray(TABLE_VALUES[fmt.name], dtype=np.float32)
        return (d[..., :1] * table[blocks.q]).reshape(n, -1)
    if fmt == IQ4_XS:
        s = np.repeat(d, 8, axis=1) * blocks.sub.view(np.int8).astype(np.float32)  # [n, kb, 1], exact
        return (s * np.asarray(IQ4_NL_VALUES, dtype=np.float32)[blocks.q]).reshape(n, -1)
    if fmt == Q5_0:
        s, o = d[..., :1], d[..., :1] * -16.0
    elif fmt == Q5_1:
        s, o = d[..., :1], d[..., 1:2]
    elif fmt == Q6_K:
        sc = blocks.sub.view(np.int8).astype(np.float32)  # [n, kb, 2]
        s = np.repeat(d, 8, axis=1) * sc
        return (np.repeat(s, 16, axis=-1) * (q - 32.0)).reshape(n, -1)
    else:
        sub = blocks.sub.astype(np.float32)
        s = np.repeat(d[..., :1], 8, axis=1) * sub[..., :1]
        o = -(np.repeat(d[..., 1:2], 8, axis=1) * sub[..., 1:2])
    return (s * q + o).reshape(n, -1)
