"""Attention backends over the paged KV cache (see base.AttentionBackend) and their per-step metadata."""

from kvpilot.model.attention.base import (ATTENTION_FEATURES, AttentionBackend, LayerAttention, StepAttention,
                                          UnsupportedAttentionError)
from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.selector import (ATTENTION_BACKENDS, check_backend_features,
                                              model_attention_features, select_attention_backend)

__all__ = ["ATTENTION_BACKENDS", "ATTENTION_FEATURES", "AttentionBackend", "LayerAttention", "StepAttention",
           "StepLayout", "UnsupportedAttentionError", "check_backend_features", "model_attention_features",
           "select_attention_backend"]
