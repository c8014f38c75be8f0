"""AmxTileWeight: a bf16 linear weight packed for AMX tiles, for decode steps of several rows and output heads'
float32 logits (csrc/bf16_gemm_amx.h through layers/cpu_bf16_ops.py): exact bf16 products, float32 sums rounded
once (bf16 out) or kept, reading the weight's bf16 bytes once a call. On CPUs whose kernel module can use the
tiles it replaces oneDNN's prepacked copy of a projection and the float32 copy of an output head (which oneDNN's
bf16 math mode reads: twice the bytes).

Layout: [N, K] -> [N / 16, Kp / 32, 16, 32]: tiles of 16 output columns by 32 k-values, K zero-padded to Kp,
within a tile row r the pairs (k = 2r, 2r + 1) of the 16 columns side by side (the B operand of TDPBF16PS).
"""

from __future__ import annotations

from typing import Any

import torch

TILE_COLS = 16
TILE_K = 32
BLOCK_COLS = 32  # the kernel computes 32 columns a pass: N must be a multiple


def amx_tiles_kernel(kernel: Any | None, weight: torch.Tensor) -> Any | None:
    """`kernel` (the bf16 ops module) when it can run `weight` on AMX tiles, else None."""
    if kernel is None or not hasattr(kernel, "has_amx_bf16") or not kernel.has_amx_bf16():
        return None
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[0] % BLOCK_COLS:
        return None
    return kernel


def pack_for_tiles(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> [N / 16, Kp / 32, 16, 32] (the module docstring's layout)."""
    n, k = weight.shape
    padded_k = -(-k // TILE_K) * TILE_K
    padded = weight
    if padded_k != k:  # else the permuted copy below is the only one made
        padded = torch.zeros(n, padded_k, dtype=weight.dtype)
        padded[:, :k] = weight
    # [n tile, column, k step, pair, 2] -> [n tile, k step, pair, column, 2]
    tiles = padded.reshape(n // TILE_COLS, TILE_COLS, padded_k // TILE_K, TILE_K // 2, 2).permute(0, 2, 3, 1, 4)
    return tiles.reshape(n // TILE_COLS, padded_k // TILE_K, TILE_K // 2, 2 * TILE_COLS).contiguous()


class AmxTileWeight:
    """A packed copy of [N, K] bf16 `weight` (N a multiple of 32; amx_tiles_kernel says where it applies)."""

    def __init__(self, weight: torch.Tensor, kernel: Any) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = pack_for_tiles(weight.detach())
        self.kernel = kernel

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def linear(self, rows: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """rows [M, K] bf16 -> [M, N] of `out_dtype` (bf16: the float32 sums + bias rounded once; float32: kept)."""
        out = torch.empty(rows.shape[0], self.out_features, dtype=out_dtype)
        self.kernel.amx_linear(out, rows.contiguous(), self.packed, bias)
        return out
