"""The int8 path's copy of a PackedLinear's weights, and TiledSet: column-tiled copies of parts of any packed format
side by side (layers/csrc/quant_tiled_set_cpu.cpp).

A fused projection's parts may differ in format (llama.cpp's Q4_K_M writes q/k as Q4_K and v as Q6_K, or with
widths that are not whole super-blocks Q5_0 and Q8_0): each keeps its own tiled copy, one kernel call quantizes x
once and writes every part's columns. Formats kept as GGUF blocks (Q5_0, Q5_1, K-quants) take the int8 path
only this way, even as a lone part.

Invariant: a part's outputs equal its own tiled copy's (TiledWeight.matmul_into for the split formats), bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.model.quant.kernel import has_vnni, require_quant_kernel
from kvpilot.model.quant.packed import PackedWeight
from kvpilot.model.quant.tiled_kquant import KTiledWeight, can_ktile, ktile
from kvpilot.model.quant.vnni_gemm import TiledWeight, can_tile, tile
from kvpilot.model.quant.vnni_layout import InterleavedWeight, interleave


@dataclass(frozen=True)
class TiledSet:
    """parts: each part's tiled copy (rows in order); codes: their formats' kernel codes."""

    parts: tuple[TiledWeight | KTiledWeight, ...]
    codes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def nbytes_beside(self, w: PackedWeight) -> int:
        """Bytes not shared with `w`: all (every part is a rearranged copy)."""
        return self.nbytes

    def tensors(self) -> list[torch.Tensor]:
        """3 tensors a part, as the kernel takes them: (tq, td, to) or (tq, td, ts)."""
        return [t for p in self.parts for t in (p.tensors() if isinstance(p, KTiledWeight) else (p.tq, p.td, p.to))]

    def matmul_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [M, N] contiguous = int8-quantized x [M, K] contiguous @ W^T; each float32 or bfloat16."""
        require_quant_kernel().quant_matmul_tiled_set(out, x, self.tensors(), list(self.codes))

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """int64 [M]: each row's argmax of what matmul_into writes in float32 (the first of equal maxima), without
        writing the logits; -1 for a row with a NaN among them."""
        return require_quant_kernel().quant_argmax_tiled_set(x, self.tensors(), list(self.codes))

    def dequantize_into(self, out: torch.Tensor) -> None:
        """out [N, K] contiguous, float32 or bfloat16 = the values (the gguf package's, bit for bit in float32)."""
        require_quant_kernel().quant_dequantize_tiled_set(out, self.tensors(), list(self.codes))

    def dequantize(self) -> torch.Tensor:
        rows = sum(int(p.tq.shape[0]) for p in self.parts) * 16
        out = torch.empty(rows, int(self.parts[0].tq.shape[1]) * 32)
        self.dequantize_into(out)
        return out


def can_tile_any(w: PackedWeight) -> bool:
    return can_tile(w) or can_ktile(w)


def tiled_set(parts: list[PackedWeight]) -> TiledSet:
    """Every part's tiled copy (built once, at load); ValueError unless each can_tile_any."""
    return TiledSet(tuple(tile(p) if can_tile(p) else ktile(p) for p in parts), tuple(p.format.code for p in parts))


def int8_copy(parts: list[PackedWeight]) -> TiledWeight | TiledSet | InterleavedWeight | None:
    """The int8 path's copy of a layer of `parts`: a lone split-format part of whole tiles, its TiledWeight (as
    before sets); parts that all tile, a TiledSet; a lone split-format part of other widths, its interleaved copy;
    anything else none (the layer keeps the float32 kernel). The interleaved layout is VNNI's alone: on AVX2
    (kernel.has_int8_tiles) those layers keep the float32 kernel."""
    if len(parts) == 1 and can_tile(parts[0]):
        return tile(parts[0])
    if all(can_tile_any(p) for p in parts):
        return tiled_set(parts)
    if len(parts) == 1 and not parts[0].format.kept_as_blocks and has_vnni():
        return interleave(parts[0])
    return None
