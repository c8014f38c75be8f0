"""Rotary position embedding (split-halves layout, as in HF Llama): per-position cos/sin tables with the
config's frequency scaling (rope_scaling.py), over all of each head or its leading rotary_dim (partial rotary)."""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.model.config import ModelConfig
from kvpilot.model.layers.cpu_bf16_ops import bf16_ops_for
from kvpilot.model.layers.gpu_small_ops import small_ops_for
from kvpilot.model.layers.rope_scaling import rotary_angles


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, rotary_dim] for positions 0..max_positions-1, looked up per token
    (positions may be arbitrary); yarn's and longrope's attention factor is folded into both, as HF does."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device: torch.device | None = None) -> None:
        """(Re)computes the tables in float32, e.g. after the module was built on the meta device."""
        config = self.config
        device = device or self.cos.device
        if device.type == "meta":
            return
        freqs, attention_factor = rotary_angles(config.rope_theta, config.rotary_dim, config.rope_scaling,
                                                self.max_positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.cos, self.sin = cos.to(device), sin.to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, rotary_dim], computed once per step and shared by all layers."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]. bfloat16 on CPU: one C++ call, bit for bit the torch ops below; CUDA: one
    Triton kernel rounding where they do. cos/sin narrower than the head (partial rotary): see below."""
    if cos.shape[-1] != x.shape[-1]:
        return apply_partial_rotary(x, cos, sin)
    ops = bf16_ops_for(x)
    if ops is not None and x.stride(-1) == 1 and cos.dtype == sin.dtype == torch.bfloat16:
        return ops.rope_bf16(x, cos.contiguous(), sin.contiguous())
    gpu = small_ops_for(x)
    if gpu is not None and x.stride(-1) == 1 and cos.dtype == sin.dtype == x.dtype:  # CUDA: one Triton kernel
        return gpu.rotary(x, cos, sin)
    return rotary_reference(x, cos, sin)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch ops (any device and dtype)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary (Phi-4-mini): the first cos.shape[-1] dimensions of each head rotate (through the same
    kernels, on a contiguous copy), the rest pass through unchanged; a new [T, heads, head_dim] tensor."""
    dim = cos.shape[-1]
    return torch.cat((apply_rotary(x[..., :dim].contiguous(), cos, sin), x[..., dim:]), dim=-1)
