"""Attention backends over the paged KV cache (see base.AttentionBackend) and their per-step metadata. The backends
and their choice live in `selector` (imported from there, not re-exported here: layers/paged_attention.py, which
the backends use, imports base, and a package that imported the backends on the way would close a cycle)."""

from kvpilot.model.attention.base import (ATTENTION_FEATURES, AttentionBackend, LayerAttention, StepAttention,
                                          UnsupportedAttentionError)
from kvpilot.model.attention.layout import StepLayout

__all__ = ["ATTENTION_FEATURES", "AttentionBackend", "LayerAttention", "StepAttention", "StepLayout",
           "UnsupportedAttentionError"]
