"""CUDA linear layers over a pre-quantized checkpoint's weights, computed by Triton kernels that dequantize in
the kernel: Int4Linear (AWQ, GPTQ, compressed-tensors 4-bit; int4_triton.py) and Fp8BlockLinear (fp8 block
scales, and per-channel layers torch's fp8 matmul cannot take; fp8_triton.py). Weight-only: activations stay in
the model's dtype.

Invariant (as PackedLinear's): a fused layer's parts (q/k/v, gate/up) that can be concatenated are (one kernel
call); the others (4-bit parts whose act-order g_idx differ) are kept apart and write side by side into one
output. The weights are plain attributes, not buffers: module-wide dtype casts leave them alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch
from torch import nn

from kvpilot.model.quant.fp8_checkpoint import Fp8Weight
from kvpilot.model.quant.int4_weight import Int4Weight

W = TypeVar("W", Int4Weight, Fp8Weight)


class _PartsLinear(nn.Module, Generic[W]):
    """y = x @ W^T (+ bias) with W the row-wise concatenation of `parts` (each has out_features, in_features
    and dequantize())."""

    def __init__(self, parts: list[W], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.offsets = [sum(p.out_features for p in parts[:i]) for i in range(len(parts))]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def matmul_into(self) -> Callable[[torch.Tensor, torch.Tensor, W], None]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized [out, in] float32 values (for inspection: a new tensor each call)."""
        return torch.cat([p.dequantize(torch.float32) for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        matmul_into = self.matmul_into()
        for part, offset in zip(self.parts, self.offsets):
            matmul_into(out[:, offset:offset + part.out_features], rows, part)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={len(self.parts)}"


class Int4Linear(_PartsLinear[Int4Weight]):
    """4-bit grouped weights; parts with the same groups are concatenated."""

    def __init__(self, parts: list[Int4Weight], bias: torch.Tensor | None) -> None:
        merged: list[list[Int4Weight]] = []
        for part in parts:
            if merged and merged[-1][0].same_groups(part):
                merged[-1].append(part)
            else:
                merged.append([part])
        super().__init__([Int4Weight.concat(run) if len(run) > 1 else run[0] for run in merged], bias)

    def matmul_into(self) -> Callable[[torch.Tensor, torch.Tensor, Int4Weight], None]:
        from kvpilot.model.quant.int4_triton import int4_matmul_into
        return int4_matmul_into


class Fp8BlockLinear(_PartsLinear[Fp8Weight]):
    """fp8 weights with scales in blocks (one fused weight: Fp8Weight.concat)."""

    def __init__(self, parts: list[Fp8Weight], bias: torch.Tensor | None) -> None:
        super().__init__([Fp8Weight.concat(parts)], bias)

    def matmul_into(self) -> Callable[[torch.Tensor, torch.Tensor, Fp8Weight], None]:
        from kvpilot.model.quant.fp8_triton import fp8_matmul_into
        return fp8_matmul_into
