"""The column-tiled copy of a PackedWeight kept as GGUF blocks (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4, IQ4_XS) for
the int8 GEMM (layers/csrc/quant_tiled_kq.h, whose header comment has the byte layout).

Like vnni_gemm.py's tiles for Q4_0 / Q4_1 / Q8_0: 16 weight rows side by side, so one vpdpbusd advances 16 outputs
by 4 values. Quants are unsigned bytes once unpacked (a nibble plane, plus a plane of 5th bits or of 2-bit highs);
the K-quants keep their two-level scales (super-block d / dmin in float16, the sub-blocks' 6-bit or int8 scales as
bytes) and the kernel multiplies them out, which is exact in float32; the table formats keep their 4-bit indices and
the kernel looks the table up in registers (IQ4_XS: with its super-block d and a byte ls - 32 per 32 values).
Bytes per weight: Q5_0 5.5, Q5_1 6, Q4_K 4.625, Q5_K 5.625, Q6_K 6.5625, IQ4_NL 4.5, MXFP4 4.5, IQ4_XS 4.3125 (the
GGUF blocks: 5.5, 6, 4.5, 5.5, 6.5625, 4.5, 4.25, 4.25: the K-quants' and IQ4_XS's 6-bit scales take a byte, MXFP4's
exponent byte becomes a float16 scale).

Invariant: the kernel's dequantization of the copy (quant_dequantize_tiled_set) equals the gguf package's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.model.quant.block_decode import DecodedBlocks, decode_blocks, tiles_exactly
from kvpilot.model.quant.formats import BLOCK_FORMATS, Q6_K, TABLE_VALUES, QuantFormat
from kvpilot.model.quant.packed import PackedWeight

TILE_ROWS = 16
_EMPTY_BYTES = torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class KTiledWeight:
    """tq uint8 [N / 16, KB, 256 | 320 | 384]; td float16 [N / 16, groups, 16 | 32]; ts uint8 [N / 16, KB, 32]
    (K-quants), [N / 16, KB, 16] (IQ4_XS) or empty."""

    format: QuantFormat
    tq: torch.Tensor
    td: torch.Tensor
    ts: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tq, self.td, self.ts))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tq, self.td, self.ts


def can_ktile(w: PackedWeight) -> bool:
    """A format kept as blocks, whole 16-row tiles, the blocks still held, and (MXFP4) scales float16 holds."""
    return (w.format.name in BLOCK_FORMATS and w.out_features % TILE_ROWS == 0 and w.qs.numel() > 0
            and tiles_exactly(w.qs.numpy(), w.format))


def ktile(w: PackedWeight) -> KTiledWeight:
    """The tiled copy of `w` (built once, at load); ValueError unless can_ktile(w)."""
    if not can_ktile(w):
        raise ValueError(f"the tiled int8 layout of GGUF blocks takes weights kept as blocks of a multiple of "
                         f"{TILE_ROWS} rows (MXFP4: scales float16 holds), not {w.format.name} with "
                         f"{w.out_features}")
    blocks = decode_blocks(w.qs.numpy(), w.format)
    t = w.out_features // TILE_ROWS
    planes = [_nibble_plane(blocks.q, t)]
    if w.format == Q6_K:
        planes.append(_two_bit_plane(blocks.q, t))
    elif w.format.name not in ("Q4_K", "IQ4_XS") and w.format.name not in TABLE_VALUES:
        planes.append(_bit_plane(blocks.q, t))
    tq = np.concatenate(planes, axis=-1)
    return KTiledWeight(w.format, _tensor(tq), _tensor(_by_tile(blocks.d, t)), _sub_scales(blocks, t))


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _by_tile(values: np.ndarray, t: int) -> np.ndarray:
    """[N, G, c] -> [N / 16, G, c * 16]: per tile and group, the 16 rows' first values, then their second ones."""
    n, g, c = values.shape
    return values.reshape(t, TILE_ROWS, g, c).transpose(0, 2, 3, 1).reshape(t, g, c * TILE_ROWS)


def _sub_scales(blocks: DecodedBlocks, t: int) -> torch.Tensor:
    return _EMPTY_BYTES if blocks.sub is None else _tensor(_by_tile(blocks.sub, t))


def _nibble_plane(q: np.ndarray, t: int) -> np.ndarray:
    """[T, KB, 256]: pair p, row j, byte k = value 8p + k | value 8p + 4 + k << 4."""
    n, kb, _ = q.shape
    low = (q & 0x0F).reshape(n, kb, 4, 2, 4)  # [row, block, pair, half, k]
    pairs = low[:, :, :, 0, :] | (low[:, :, :, 1, :] << 4)
    return pairs.reshape(t, TILE_ROWS, kb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(t, kb, 256)


def _bit_plane(q: np.ndarray, t: int) -> np.ndarray:
    """[T, KB, 64]: row j's uint32, byte k: bit p = value (8p + k)'s 5th bit, bit 4 + p = value (8p + 4 + k)'s."""
    n, kb, _ = q.shape
    high = ((q >> 4) & 1).reshape(n, kb, 4, 2, 4).astype(np.uint8)  # [row, block, pair, half, k]
    shift = (np.arange(4, dtype=np.uint8)[:, None] + 4 * np.arange(2, dtype=np.uint8)[None, :])[..., None]
    packed = (high << shift).sum(axis=(2, 3), dtype=np.uint8)  # [row, block, k]: distinct bits, so sum = or
    return packed.reshape(t, TILE_ROWS, kb, 4).transpose(0, 2, 1, 3).reshape(t, kb, 64)


def _two_bit_plane(q: np.ndarray, t: int) -> np.ndarray:
    """[T, KB, 128]: per half r of the pairs (pairs 2r, 2r + 1), row j's uint32, byte k: bits 4i, 4i + 2 = the 2
    high bits of values 8p + k and 8p + 4 + k for pair p = 2r + i."""
    n, kb, _ = q.shape
    high = ((q >> 4) & 3).reshape(n, kb, 2, 2, 2, 4).astype(np.uint8)  # [row, block, r, i, half, k]
    shift = (4 * np.arange(2, dtype=np.uint8)[:, None] + 2 * np.arange(2, dtype=np.uint8)[None, :])[..., None]
    packed = (high << shift).sum(axis=(3, 4), dtype=np.uint8)  # [row, block, r, k]
    return packed.reshape(t, TILE_ROWS, kb, 2, 4).transpose(0, 2, 3, 1, 4).reshape(t, kb, 128)
