"""The attention-backend interface: each backend owns its KV-cache layout, builds its per-step metadata from
a StepLayout, and runs attention over the paged cache for every layer."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvpilot.model.attention.layout import StepLayout


class AttentionBackend(Protocol):
    """Invariants: build() is called once per step, before the forward; forward() writes the step's K/V
    into kv_cache first, so every query sees its own and all earlier tokens of its sequence."""

    name: str

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor."""
        ...

    def build(self, layout: StepLayout, device: torch.device) -> Any:
        """The step's metadata, on `device`."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                scale: float) -> torch.Tensor:
        """q: [T, heads, D], k/v: [T, kv_heads, D] for this step's tokens -> [T, heads, D]."""
        ...


class StepAttention:
    """A backend bound to one step's metadata: what the model's layers call (no hidden globals)."""

    def __init__(self, backend: AttentionBackend, meta: Any) -> None:
        self.backend = backend
        self.meta = meta

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
        return self.backend.forward(q, k, v, kv_cache, self.meta, scale)
