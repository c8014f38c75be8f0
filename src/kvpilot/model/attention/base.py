"""The attention-backend interface: each backend owns its KV-cache layout, builds its per-step metadata from
a StepLayout, and runs attention over the paged cache for every layer, as that layer's LayerAttention says."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

import torch

from kvpilot.model.attention.layout import StepLayout

SLIDING_WINDOW = "sliding_window"
LOGIT_SOFTCAP = "logit_softcap"
SINKS = "sinks"
# every attention variant a layer can ask for beyond plain scaled causal attention
ATTENTION_FEATURES: frozenset[str] = frozenset({SLIDING_WINDOW, LOGIT_SOFTCAP, SINKS})


@dataclass(frozen=True, eq=False)
class LayerAttention:
    """How one layer attends (the model builds one per layer at load and passes it on every call).

    Semantics, HF transformers' exactly: scores = q.k * scale; with `logit_softcap` c, scores = c * tanh(scores
    / c) (Gemma 2), before the mask; with `sliding_window` W, the query at position i sees the keys j with
    i - W < j <= i (W keys, itself included; transformers' masking_utils.sliding_window_overlay), else all
    j <= i; with `sinks` (gpt-oss), sinks[h] joins query head h's softmax denominator as a logit with no
    value: p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h])).

    Invariants: scale > 0; sliding_window >= 1 or None; logit_softcap > 0 or None; sinks a 1-D float32 tensor
    of the layer's query heads, on the model's device, or None. `features` names the variants in use (a subset
    of ATTENTION_FEATURES). kv_group: the KV group whose block tables the layer reads when a step has several
    (engine/kv_groups.py; ModelConfig.layer_kv_group). eq=False: compared by identity (a tensor field has no
    truth value; a runner's fp8 KV scales are keyed by it, model/kv_scales.py)."""

    scale: float
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: torch.Tensor | None = None
    kv_group: int = 0
    features: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"attention scale must be positive, got {self.scale}")
        if self.sliding_window is not None and (int(self.sliding_window) != self.sliding_window
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer, got {self.sliding_window}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive, got {self.logit_softcap}")
        if self.sinks is not None and (self.sinks.dim() != 1 or self.sinks.dtype != torch.float32):
            raise ValueError(f"sinks must be a 1-D float32 tensor (one logit per query head), got "
                             f"{tuple(self.sinks.shape)} {self.sinks.dtype}")
        used = ((SLIDING_WINDOW, self.sliding_window), (LOGIT_SOFTCAP, self.logit_softcap), (SINKS, self.sinks))
        object.__setattr__(self, "features", frozenset(name for name, value in used if value is not None))

    @property
    def window(self) -> int:
        """The sliding window, 0 when none (the kernels' spelling)."""
        return int(self.sliding_window or 0)

    @property
    def softcap(self) -> float:
        """The soft-cap, 0.0 when none (the kernels' spelling)."""
        return float(self.logit_softcap or 0.0)


@lru_cache(maxsize=64)
def plain_attention(scale: float) -> LayerAttention:
    """The LayerAttention of a plain causal layer (one object per scale: no allocation per call)."""
    return LayerAttention(scale)


def as_layer_attention(scale_or_layer: float | LayerAttention) -> LayerAttention:
    """A LayerAttention as given, or a plain one for a bare scale (what callers before variants pass)."""
    if isinstance(scale_or_layer, LayerAttention):
        return scale_or_layer
    return plain_attention(float(scale_or_layer))


class AttentionBackend(Protocol):
    """Invariants: build() is called once per step, before the forward; forward() writes the step's K/V
    into kv_cache first, so every query sees its own and all earlier tokens of its sequence (within its
    window). `features` lists the LayerAttention variants the backend computes; it never ignores one."""

    name: str
    features: frozenset[str]

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor."""
        ...

    def build(self, layout: StepLayout, device: torch.device, *, group: int = 0) -> Any:
        """The step's metadata, on `device`; `group`: the KV group whose layout it is (engine/kv_groups.py):
        the metadata of a step's groups must all stay valid until its forward ends."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                layer: LayerAttention) -> torch.Tensor:
        """q: [T, heads, D], k/v: [T, kv_heads, D] for this step's tokens -> [T, heads, D]."""
        ...


class UnsupportedAttentionError(RuntimeError):
    """A layer asked a backend for an attention variant it does not compute (the load-time check,
    selector.check_backend_features, should have refused the model first)."""


class StepAttention:
    """A backend bound to one step's metadata: what the model's layers call (no hidden globals). With KV
    groups (engine/kv_groups.py) `group_metas` holds each group's metadata, `meta` group 0's, and a layer
    reads its LayerAttention.kv_group's; with one group every layer reads `meta`."""

    def __init__(self, backend: AttentionBackend, meta: Any, group_metas: Sequence[Any] = (), *,
                 kv_scales: Mapping[int, Any] | None = None, calibrate: bool = False) -> None:
        """kv_scales: the runner's fp8 KV scales by id of each layer's LayerAttention (model/kv_scales.py), folded
        around the backend; calibrate: a serving step's forward, whose K/V may set those not set yet (never a
        profiling or graph-capture run)."""
        self.backend = backend
        self.meta = meta
        self.group_metas = group_metas
        self.kv_scales = kv_scales
        self.calibrate = calibrate

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 scale_or_layer: float | LayerAttention) -> torch.Tensor:
        """scale_or_layer: the layer's LayerAttention, or a bare scale for plain causal attention."""
        layer = as_layer_attention(scale_or_layer)
        if layer.features and not layer.features <= self.backend.features:
            missing = ", ".join(sorted(layer.features - self.backend.features))
            raise UnsupportedAttentionError(f"the {self.backend.name} attention backend does not compute {missing}")
        meta = self.group_metas[layer.kv_group] if self.group_metas else self.meta
        scales = self.kv_scales.get(id(layer)) if self.kv_scales else None  # a layer without any: scale 1
        if scales is not None:
            return scales.attend(self.backend, q, k, v, kv_cache, meta, layer, self.calibrate)
        return self.backend.forward(q, k, v, kv_cache, meta, layer)
