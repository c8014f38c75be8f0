"""Fp8Weight: one [N, K] linear weight of an fp8 checkpoint, float8 e4m3 values with float32 scales in blocks.

Every scale layout is a block shape: w[n, k] = weight[n, k] * scale[n // block[0], k // block[1]], the scale
[ceil(N / block[0]), ceil(K / block[1])]. Per-tensor is block (N, K) (one scale), per-channel (1, K), 128x128
blocks (Qwen's -FP8, DeepSeek; compressed-tensors strategy block) are themselves. Dequantizing is exact in
float32 (an e4m3 value has 4 significant bits). Fusing parts of one layer (q/k/v, gate/up) concatenates along N:
per-tensor parts become per-channel first; block parts whose rows do not end on a block boundary get their scale
rows repeated per weight row (block (1, block[1]): the same values, ceil(N / block[0]) fold more scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.model.errors import ModelLoadError
from kvpilot.model.quant.checkpoint_scheme import Fp8Scheme

FP8_DTYPE = torch.float8_e4m3fn


@dataclass
class Fp8Weight:
    """weight float8_e4m3fn [N, K]; scale float32 [ceil(N / block[0]), ceil(K / block[1])]."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * self.scale.element_size()

    @property
    def per_channel(self) -> bool:
        """One scale a row (or a tensor's one scale): what a row-scaled fp8 matmul takes."""
        return self.block[1] >= self.in_features and (self.block[0] == 1 or self.block[0] >= self.out_features)

    def channel_scales(self) -> torch.Tensor:
        """float32 [N]: each row's scale; ValueError unless per_channel."""
        if not self.per_channel:
            raise ValueError(f"block {self.block} scales are not one a row")
        return self.scale.reshape(-1).expand(self.out_features).contiguous() if self.scale.numel() == 1 \
            else self.scale.reshape(-1).contiguous()

    def row_scales(self) -> Fp8Weight:
        """The same values with block (1, block[1]): a scale row per weight row."""
        rows = self.scale.repeat_interleave(self.block[0], dim=0)[: self.out_features]
        return Fp8Weight(self.weight, rows.contiguous(), (1, self.block[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.weight.shape
        scale = self.scale.repeat_interleave(self.block[0], dim=0)[:n].repeat_interleave(self.block[1], dim=1)[:, :k]
        return (self.weight.to(torch.float32) * scale).to(dtype)

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device), self.scale.to(device), self.block)

    @classmethod
    def concat(cls, parts: list[Fp8Weight]) -> Fp8Weight:
        """Parts of one layer stacked along N (see the module docstring); ValueError when their column blocks
        differ."""
        if len(parts) == 1:
            return parts[0]
        if all(p.per_channel for p in parts):
            scale = torch.cat([p.channel_scales() for p in parts]).reshape(-1, 1)
            return cls(torch.cat([p.weight for p in parts]), scale, (1, parts[0].in_features))
        if len({p.block for p in parts}) != 1:
            raise ValueError(f"fp8 parts with different blocks {[p.block for p in parts]} do not fuse")
        rows = parts[0].block[0]
        if any(p.out_features % rows for p in parts[:-1]):
            parts = [p.row_scales() for p in parts]
        return cls(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), parts[0].block)


def read_fp8(tensors: dict[str, torch.Tensor], scheme: Fp8Scheme, name: str) -> Fp8Weight:
    """The Fp8Weight of module `name` from its `weight` and scale tensors (suffix -> tensor); the scale's shape
    tells per-tensor from per-channel where the scheme has no block; ModelLoadError when it fits neither."""
    weight, scale = tensors["weight"], tensors[scheme.scale_name]
    if weight.dtype != FP8_DTYPE:
        raise ModelLoadError(f"{name}.weight is {weight.dtype}: kvpilot reads float8_e4m3fn fp8 weights")
    if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelLoadError(f"{name}.{scheme.scale_name} is {scale.dtype}: kvpilot reads float scales")
    scale = scale.to(torch.float32)
    n, k = weight.shape
    if scheme.block is not None:
        bn, bk = scheme.block
        expected = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != expected:
            raise ModelLoadError(f"{name}.{scheme.scale_name} has shape {tuple(scale.shape)}; {scheme.block} blocks "
                                 f"of a {n} x {k} weight need {expected}")
        return Fp8Weight(weight, scale.contiguous(), scheme.block)
    if scale.numel() == 1:
        return Fp8Weight(weight, scale.reshape(1, 1), (n, k))
    if tuple(scale.shape) in ((n,), (n, 1)):
        return Fp8Weight(weight, scale.reshape(n, 1).contiguous(), (1, k))
    raise ModelLoadError(f"{name}.{scheme.scale_name} has shape {tuple(scale.shape)}: neither one scale nor one "
                         f"a row of the {n} x {k} weight (kvpilot reads fp8 scales per tensor, per channel or in "
                         "blocks)")
