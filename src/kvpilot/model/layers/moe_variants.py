"""What a family's mixture-of-experts layer computes beyond layers.moe's default (softmax over every expert,
top k, SiLU-gated experts without biases): gpt-oss's router and its clamped SwiGLU, as transformers computes
them (models/gpt_oss/modeling_gpt_oss.py: GptOssTopKRouter, GptOssExperts._apply_gate).

Both act on kvpilot's expert layout, whose gate_up rows hold every gate row first, then every up row (the
loader de-interleaves gpt-oss's alternating gate/up columns into it: models/gpt_oss.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def route_top_k_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E]: the top k logits first
    (torch.topk's order and ties), then the softmax over those k alone, in float32 (gpt-oss; the weights sum
    to 1 with no renormalisation)."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values.float(), dim=-1), ids


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gated activation of gate-first rows [N, 2*I] -> [N, I]:
    gate clamped to at most `limit`, up clamped to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).

    Invariants: alpha > 0 and limit > 0 (the config's swiglu_alpha and swiglu_limit: 1.702 and 7.0 in every
    released checkpoint)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if not (self.alpha > 0 and self.limit > 0):
            raise ValueError(f"swiglu_alpha ({self.alpha}) and swiglu_limit ({self.limit}) must be positive")

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        # transformers' order of operations, so float32 matches it bit for bit
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
