"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2's modules (kvpilot.model.models.gemma2)
with three differences, as HF transformers computes them:

- q and k are normed per head (Gemma's (1 + weight) RMSNorm over head_dim) before the rotary embedding;
- no soft-capping unless the config asks for it (transformers' Gemma 3 defaults are None, Gemma 2's 50/30);
- RoPE per layer type: sliding layers rotate with `rope_local_base_freq` (10,000 by default, never scaled),
  global layers with `rope_theta` (1,000,000 by default) and the config's rope scaling. Two tables
  (`LayerTypeRotary`), each computed once a step and handed to the layers of its type.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvpilot.fit.model_spec import text_config
from kvpilot.model.attention.base import StepAttention
from kvpilot.model.config import ModelConfig
from kvpilot.model.layers.rope import RotaryEmbedding, apply_rotary
from kvpilot.model.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, GemmaRMSNorm

FULL, SLIDING = "full_attention", "sliding_attention"
DEFAULT_GLOBAL_THETA, DEFAULT_LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma3TextConfig


@dataclass(frozen=True)
class Gemma3RopeBases:
    """The RoPE base of each layer type. Invariant: both > 0."""

    full: float
    sliding: float

    @classmethod
    def from_config(cls, config: ModelConfig) -> Gemma3RopeBases:
        """From either config layout: transformers 4.x (`rope_theta`, `rope_local_base_freq`) or 5.x
        (`rope_parameters` keyed by layer type)."""
        extra = text_config(config.extra)
        by_type = extra.get("rope_parameters") or {}
        return cls(_theta(by_type.get(FULL), extra.get("rope_theta"), DEFAULT_GLOBAL_THETA),
                   _theta(by_type.get(SLIDING), extra.get("rope_local_base_freq"), DEFAULT_LOCAL_THETA))


def _theta(params: Any, flat: Any, default: float) -> float:
    if isinstance(params, dict) and params.get("rope_theta"):
        return float(params["rope_theta"])
    return float(flat or default)


class LayerTypeRotary(nn.Module):
    """The cos/sin tables of both layer types (loader and kv_budget use `reset_tables` and `max_positions`,
    as of the shared RotaryEmbedding). The global table keeps the config's rope scaling; the sliding one has
    none."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        bases = Gemma3RopeBases.from_config(config)
        self.full = RotaryEmbedding(dataclasses.replace(config, rope_theta=bases.full), max_positions)
        self.sliding = RotaryEmbedding(dataclasses.replace(config, rope_theta=bases.sliding, rope_scaling=None),
                                       max_positions)
        self.max_positions = max_positions

    def reset_tables(self, device: torch.device | None = None) -> None:
        self.full.reset_tables(device)
        self.sliding.reset_tables(device)

    def tables(self, positions: torch.Tensor,
               dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Layer type -> (cos, sin) of shape [T, 1, head_dim]."""
        return {FULL: self.full.tables(positions, dtype), SLIDING: self.sliding.tables(positions, dtype)}


class Gemma3Attention(Gemma2Attention):
    """Gemma 2's attention with q_norm and k_norm (HF names) before the rotary embedding."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        self.layer_type = SLIDING if config.layer_window(layer_idx) is not None else FULL


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's model with a RoPE table per layer type: each layer rotates with its own."""

    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.rotary = LayerTypeRotary(config, max_positions)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn: StepAttention) -> torch.Tensor:
        if self.int8_gate is not None:  # as the shared forward: prompt tokens stay off the int8 path
            self.int8_gate.for_step(bool(getattr(attn.meta, "prefills", ())))
        x = self.embed(token_ids)
        tables = self.rotary.tables(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, *tables[layer.layer_type], kv_cache, attn)
        return self.norm(x)
