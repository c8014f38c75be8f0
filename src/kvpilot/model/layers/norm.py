"""RMSNorm, computed in float32 like the HF reference so fp32 outputs match token for token. bfloat16
activations on CPU take the C++ kernel (cpu_bf16_ops.py), CUDA tensors a Triton kernel (gpu_small_ops.py):
the same arithmetic in one call."""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.model.layers.cpu_bf16_ops import bf16_ops_for
from kvpilot.model.layers.gpu_small_ops import small_ops_for


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = bf16_ops_for(x) if self.weight.dtype == torch.bfloat16 else None
        if ops is not None:
            return ops.rms_norm_bf16(x.contiguous(), self.weight, self.eps)
        gpu = small_ops_for(x)
        if gpu is not None and x.stride(-1) == 1 and x.dim() <= 3:  # CUDA: one Triton kernel
            return gpu.rms_norm(x, self.weight, self.eps)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch ops (any device and dtype)."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
