"""Rotary position embedding (split-halves layout, as in HF Llama), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvpilot.model.config import ModelConfig, RopeScaling
from kvpilot.model.layers.cpu_bf16_ops import bf16_ops_for
from kvpilot.model.layers.gpu_small_ops import small_ops_for


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short kept, a smooth blend between."""
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..max_positions-1, looked up per token (positions may be arbitrary)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device: torch.device | None = None) -> None:
        """(Re)computes the tables in float32, e.g. after the module was built on the meta device."""
        dim, config = self.config.head_dim, self.config
        device = device or self.cos.device
        if device.type == "meta":
            return
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if config.rope_scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, config.rope_scaling)
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim], computed once per step and shared by all layers."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]. bfloat16 on CPU: one C++ call, bit for bit the torch ops below; CUDA: one
    Triton kernel rounding where they do."""
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
