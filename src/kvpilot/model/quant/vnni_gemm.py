"""The column-tiled copy of a Q4_0 / Q4_1 / Q8_0 PackedWeight for the int8 GEMM of many rows
(layers/csrc/quant_vnni_gemm.h).

Weight rows go in tiles of 16; for each tile and block, Q4: pair p (0..3) holds each row's GGUF nibble bytes
4p..4p+3 side by side (64 bytes); Q8_0: group g (0..7) holds each row's values 4g..4g+3 as q + 128 (unsigned, as
vpdpbusd takes them). So one 512-bit vpdpbusd advances 16 outputs of an x row by 4 values, and a tile of 8 x rows
reuses each weight register 8 times. Scales and offsets ("d * q + o") are laid out the same way, 16 per tile and
block; only Q4_1 stores offsets (its m): Q4_0's -8 d and Q8_0's -128 d are derived by the kernel (exact), so `to`
is empty and a decode step streams one array less. The copy takes no more bytes than the GGUF blocks.

Invariant: dequantize_tiled(tile(w)) equals w.dequantize().
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.model.quant.formats import Q4_0, Q4_1, Q8_0
from kvpilot.model.quant.kernel import require_quant_kernel
from kvpilot.model.quant.packed import PackedWeight

TILE_ROWS = 16


@dataclass(frozen=True)
class TiledWeight:
    """tq: uint8 [N / 16, KB, 256] (Q4) or [N / 16, KB, 512] (Q8_0); td, to: float16 [N / 16, KB, 16], `to` empty
    but for Q4_1 (Q4_0's and Q8_0's offsets derive from td)."""

    tq: torch.Tensor
    td: torch.Tensor
    to: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tq, self.td, self.to))

    def nbytes_beside(self, w: PackedWeight) -> int:
        """Bytes not shared with `w`: all (the scales are rearranged copies)."""
        return self.nbytes

    def matmul_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [M, N] contiguous = int8-quantized x [M, K] contiguous @ W^T; each float32 or bfloat16."""
        require_quant_kernel().quant_matmul_tiled(out, x, self.tq, self.td, self.to)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """int64 [M]: each row's argmax of what matmul_into writes in float32 (the first of equal maxima), without
        writing [M, N] logits; -1 for a row with a NaN among them."""
        return require_quant_kernel().quant_argmax_tiled(x, self.tq, self.td, self.to)

    def dequantize_into(self, out: torch.Tensor) -> None:
        """out [N, K] contiguous, float32 or bfloat16 = the values (as PackedWeight.dequantize_into computes
        them from the blocks), for a layer whose only copy of its blocks this is."""
        require_quant_kernel().quant_dequantize_tiled(out, self.tq, self.td, self.to)


def can_tile(w: PackedWeight) -> bool:
    """A whole number of 16-row tiles (every projection and output layer of the models kvpilot ships)."""
    return w.format in (Q4_0, Q4_1, Q8_0) and w.out_features % TILE_ROWS == 0 and w.qs.numel() > 0


def tile(w: PackedWeight) -> TiledWeight:
    """The tiled copy of `w` (built once, at load); ValueError unless can_tile(w)."""
    if not can_tile(w):
        raise ValueError(f"the tiled int8 layout takes Q4_0 / Q4_1 / Q8_0 weights of a multiple of {TILE_ROWS} "
                         f"rows, not {w.format.name} with {w.out_features}")
    n, kb = w.d.shape
    t = n // TILE_ROWS
    d = w.d.numpy()
    no_offsets = torch.empty(0, dtype=torch.float16)
    if w.format == Q8_0:
        q = w.qs.numpy().view(np.uint8) ^ np.uint8(0x80)  # int8 q + 128 as a byte
        return TiledWeight(_groups_by_row(q, t, kb, 8), _tiles(d, t, kb), no_offsets)
    offsets = _tiles(w.m.numpy(), t, kb) if w.format == Q4_1 else no_offsets
    return TiledWeight(_groups_by_row(w.qs.numpy(), t, kb, 4), _tiles(d, t, kb), offsets)


def _groups_by_row(q: np.ndarray, t: int, kb: int, groups: int) -> torch.Tensor:
    """Bytes [N, KB, 4 groups] -> [T, KB, group, row, 4 bytes]: 4-byte groups moved as uint32 (~10x faster than
    moving the bytes one by one)."""
    words = np.ascontiguousarray(q).view(np.uint32).reshape(t, TILE_ROWS, kb, groups).transpose(0, 2, 3, 1)
    return torch.from_numpy(np.ascontiguousarray(words).view(np.uint8).reshape(t, kb, groups * 4 * TILE_ROWS))


def _tiles(values: np.ndarray, t: int, kb: int) -> torch.Tensor:
    """[N, KB] -> [N / 16, KB, 16]."""
    return torch.from_numpy(np.ascontiguousarray(values.reshape(t, TILE_ROWS, kb).transpose(0, 2, 1)))


def dequantize_tiled(v: TiledWeight) -> torch.Tensor:
    """float32 [N, K]: the values the layout holds (for tests)."""
    t, kb, width = v.tq.shape
    if width == 512:  # Q8_0: q + 128 in groups of 4 values
        q = v.tq.numpy().reshape(t, kb, 8, TILE_ROWS, 4).transpose(0, 3, 1, 2, 4).reshape(t * TILE_ROWS, kb, 32)
        q = q.astype(np.float32)
    else:
        raw = v.tq.numpy().reshape(t, kb, 4, TILE_ROWS, 4).transpose(0, 3, 1, 2, 4).reshape(t * TILE_ROWS, kb, 16)
        q = np.concatenate([raw & 0x0F, raw >> 4], axis=-1).astype(np.float32)  # values 0..15, then 16..31
    d, o = (a.numpy().transpose(0, 2, 1).reshape(t * TILE_ROWS, kb, 1).astype(np.float32) if a.numel() else None
            for a in (v.td, v.to))
    if o is None:  # Q4_0's and Q8_0's offsets: -8 d and -128 d
        o = d * (-128.0 if width == 512 else -8.0)
    return torch.from_numpy((q * d + o).reshape(t * TILE_ROWS, -1))
