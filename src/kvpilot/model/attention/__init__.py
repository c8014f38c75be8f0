"""Attention backends over the paged KV cache (see base.AttentionBackend) and their per-step metadata."""

from kvpilot.model.attention.base import AttentionBackend, StepAttention
from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.selector import ATTENTION_BACKENDS, select_attention_backend

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "StepAttention", "StepLayout", "select_attention_backend"]
