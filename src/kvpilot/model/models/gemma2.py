"""Gemma 2 (Gemma2ForCausalLM): the shared decoder with Gemma's differences, as HF transformers computes them.

- RMSNorm scales by (1 + weight), in float32, rounding once at the end (`GemmaRMSNorm`); the checkpoint's
  weights are zero-centred (llama.cpp's GGUF stores them with the 1 added: kvpilot.model.gguf_weights
  takes it off again).
- Four norms a layer: around attention (input, post-attention) and around the MLP (pre-, post-feedforward),
  each sub-block's output normed before the residual add.
- Input embeddings times sqrt(hidden_size), that factor rounded to the model dtype first.
- A GeGLU MLP: gelu (tanh approximation, `hidden_activation`) of the gate times up.
- Attention scale query_pre_attn_scalar**-0.5 (not head_dim's), tanh soft-capping of the attention logits and
  of the final logits, and interleaved sliding-window / global layers (ModelConfig.layer_types).

Family-only facts come from ModelConfig.extra (the raw HF config), with transformers' defaults where a
config.json leaves a key out (`GemmaSettings`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.fit.model_spec import text_config
from kvpilot.model.attention.base import LayerAttention, StepAttention
from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.layers.rope import apply_rotary
from kvpilot.model.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM

# hidden_activation -> F.gelu's `approximate` (the torch ops transformers' ACT2FN runs for these names);
# Gemma checkpoints use the tanh approximation, transformers' default
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class GemmaSettings:
    """The Gemma facts ModelConfig does not carry. Invariant: query_pre_attn_scalar > 0; a soft-cap is None
    (off) or > 0; gelu_approximate is one of F.gelu's ("tanh", "none")."""

    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    gelu_approximate: str

    @classmethod
    def from_config(cls, config: ModelConfig, softcap_defaults: tuple[float | None, float | None]) -> GemmaSettings:
        """From config.extra; `softcap_defaults` (attention, final) are the family's transformers defaults,
        used where the key is absent (a key present as null turns the cap off, as in transformers)."""
        extra = text_config(config.extra)
        activation = str(extra.get("hidden_activation") or "gelu_pytorch_tanh")  # not hidden_act, as HF
        if activation not in GELU_APPROXIMATIONS:
            raise ModelLoadError(f"{config.name or config.architecture}: hidden_activation {activation!r} is not "
                                 f"a Gemma activation kvpilot runs ({', '.join(GELU_APPROXIMATIONS)})")
        scalar = float(extra.get("query_pre_attn_scalar") or 256)
        attn_cap = _softcap(extra, "attn_logit_softcapping", softcap_defaults[0])
        final_cap = _softcap(extra, "final_logit_softcapping", softcap_defaults[1])
        return cls(scalar, attn_cap, final_cap, GELU_APPROXIMATIONS[activation])


def _softcap(extra: dict[str, Any], key: str, default: float | None) -> float | None:
    value = extra.get(key, default)
    return float(value) if value else None  # 0 or null: no cap


def gemma_settings(config: ModelConfig) -> GemmaSettings:
    """The family's settings with its own transformers defaults (Gemma 2 caps by default, Gemma 3 does not)."""
    defaults = (50.0, 30.0) if config.family == "gemma2" else (None, None)
    return GemmaSettings.from_config(config, defaults)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, rounded to x's dtype once (HF's Gemma2RMSNorm: Llama's rounds
    before the weight). `weight` is zero-centred, as the HF checkpoint stores it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(MLP):
    """down(gelu(gate) * up), gate and up from one fused matmul (the shared MLP's parameters and names)."""

    def __init__(self, config: ModelConfig, gelu_approximate: str) -> None:
        super().__init__(config)
        self.gelu_approximate = gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.gelu_approximate) * up)


class Gemma2Attention(Attention):
    """The shared attention's projections, with the layer's LayerAttention: scale from query_pre_attn_scalar,
    its sliding window (None on global layers) and the logit soft-cap."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        settings = gemma_settings(config)
        self.scale = settings.query_pre_attn_scalar ** -0.5
        self.layer_attention = LayerAttention(self.scale, self.sliding_window, settings.attn_logit_softcapping,
                                              kv_group=config.layer_kv_group(layer_idx))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                attn: StepAttention) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotate(q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                           cos, sin)
        out = attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), kv_cache, self.layer_attention)
        return self.o_proj(out.reshape(-1, self.q_size))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k [T, kv_heads, D] with rotary applied (Gemma 3 norms them first)."""
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class Gemma2DecoderLayer(DecoderLayer):
    """x + post_attn_norm(attn(input_norm(x))), then the same with the MLP's pre- and post-feedforward norms."""

    attention_class = Gemma2Attention
    supports_deferred_add = False  # norms after the sub-blocks: not the CUDA fused add+norm pattern

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return GemmaMLP(config, gemma_settings(config).gelu_approximate)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                attn: StepAttention) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


@lru_cache(maxsize=8)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` as transformers multiplies by it: a float32 tensor cast to `dtype` (sqrt(3584) is 59.75 in
    bfloat16)."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))


class Gemma2ForCausalLM(LlamaForCausalLM):
    """The shared model with scaled input embeddings, a Gemma final norm and soft-capped logits; the output
    layer is the embedding table (tied) unless the config unties it."""

    layer_class = Gemma2DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = math.sqrt(config.hidden_size)
        self.final_logit_softcapping = gemma_settings(config).final_logit_softcapping

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(token_ids)
        return x * _rounded(self.embed_scale, x.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """cap * tanh(logits / cap) in float32 (monotone: a packed head's greedy_ids stays right)."""
        logits = super().logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
