"""gpt-oss (GptOssForCausalLM): the shared decoder with OpenAI's differences, as HF transformers computes them.

- Attention with biases on q/k/v and o, and a learned sink logit per query head (LayerAttention.sinks: it joins
  the head's softmax denominator); layers alternate sliding-window (128) and full attention
  (ModelConfig.layer_types); YaRN RoPE (layers/rope_scaling.py).
- A mixture of experts in every layer (layers/moe_variants.py): the router has a bias, takes the top k logits
  and then the softmax over those k; each expert's gate_up and down projections have biases, and its
  activation is the clamped SwiGLU (swiglu_alpha, swiglu_limit).
- Weights: OpenAI's MXFP4 experts or save_pretrained's dequantized ones (models/gpt_oss_weights.py); the
  router at mlp.router, sinks at self_attn.sinks; or llama.cpp's `gpt-oss` GGUF (gguf_weights.py names its
  tensors). On a CPU the MXFP4 experts of either stay packed (loader.py, quant/model_pack.pack_experts).

Chat: gpt-oss speaks the harmony format, which its chat template writes; `<|return|>` and `<|call|>` end
generation (model/stop_tokens.py). Responses are returned as the model writes them (analysis and final
channels in one text): kvpilot has no harmony output parser yet.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.model.attention.base import LayerAttention, StepAttention
from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.layers.moe import Experts, SparseMoeBlock
from kvpilot.model.layers.moe_variants import ClampedSwiGLU, route_top_k_softmax
from kvpilot.model.layers.rope import apply_rotary
from kvpilot.model.models.gpt_oss_weights import (convert_dense_experts, load_mxfp4_experts, log_dequantized_memory,
                                                  stack_gguf_expert_biases)
from kvpilot.model.models.llama import fuse_hf_state_dict
from kvpilot.model.models.moe_decoder import HF_EXPERT_NAMES, MoeDecoderLayer, MoeForCausalLM, stack_experts


class GptOssAttention(nn.Module):
    """Fused q/k/v (with biases), rotary, paged attention with this layer's window and sinks, o_proj (with a
    bias). `sinks` [heads] is a parameter in the model's dtype, as the checkpoint stores it; the attention
    backends read it as float32 (`layer_attention`)."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.q_size, self.kv_size = config.head_dim, config.q_size, config.kv_size
        self.scale = self.head_dim ** -0.5
        self.sliding_window = config.layer_window(layer_idx)
        self.kv_group = config.layer_kv_group(layer_idx)
        bias = bool(config.extra.get("attention_bias", True))  # transformers' default for gpt-oss
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        self._sinks_key: tuple[object, ...] | None = None
        self._layer_attention: LayerAttention | None = None

    @property
    def layer_attention(self) -> LayerAttention:
        """The layer's LayerAttention, its sinks a float32 copy of `sinks` (the parameter itself in float32),
        rebuilt whenever the parameter changed (loaded, filled, moved): its version counter and address tell."""
        sinks = self.sinks
        key = (sinks.data_ptr(), sinks._version, sinks.device, sinks.dtype)
        if self._layer_attention is None or key != self._sinks_key:
            self._layer_attention = LayerAttention(self.scale, self.sliding_window, sinks=sinks.detach().float(),
                                                   kv_group=self.kv_group)
            self._sinks_key = key
        return self._layer_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                attn: StepAttention) -> torch.Tensor:
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads are adjacent: rotated in one pass
        qk = apply_rotary(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), kv_cache, self.layer_attention)
        return self.o_proj(out.reshape(-1, self.q_size))


class GptOssMoeBlock(SparseMoeBlock):
    """The router (with a bias) routing each token to its top k experts, weighted by the softmax of those k
    logits; experts with biases and the clamped SwiGLU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                         config.moe_intermediate_size, renormalize=False)
        extra = config.extra
        activation = ClampedSwiGLU(float(extra.get("swiglu_alpha", 1.702)), float(extra.get("swiglu_limit", 7.0)))
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=True)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size, bias=True,
                               activation=activation)

    def route(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_top_k_softmax(self.gate(rows), self.top_k)


class GptOssDecoderLayer(MoeDecoderLayer):
    attention_class = GptOssAttention

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return GptOssMoeBlock(config)


class GptOssForCausalLM(MoeForCausalLM):
    layer_class = GptOssDecoderLayer

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """The keys whose transformers defaults (128-token window, YaRN x32 on theta 150,000) the parser does
        not apply: a config without them would load as a different model than transformers builds."""
        super().check_config(config)
        extra, source = config.extra, config.name or config.architecture
        params = extra.get("rope_parameters") or {}
        needed = {"sliding_window": extra.get("sliding_window"),
                  "rope_scaling": extra.get("rope_scaling") or params.get("rope_type"),
                  "rope_theta": extra.get("rope_theta") or params.get("rope_theta")}
        missing = [key for key, value in needed.items() if not value]
        if missing:
            raise ModelLoadError(f"{source}: a gpt-oss config needs {', '.join(missing)} (the released "
                                 "checkpoints' config.json has them); is this config.json complete?")

    def hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names -> this module's; MXFP4 experts are dequantized into their parameters here, which the state
        then holds (loading copies them onto themselves: a no-op)."""
        mxfp4_bytes = sum(t.nbytes for name, t in state.items() if name.endswith(("_blocks", "_scales")))
        out = fuse_hf_state_dict(state, self.config)
        for i, layer in enumerate(self.layers):
            prefix, experts = f"layers.{i}.mlp", layer.mlp.experts
            for kind in ("weight", "bias"):
                router = out.pop(f"{prefix}.router.{kind}", None)
                if router is not None:
                    out[f"{prefix}.gate.{kind}"] = router
            convert_dense_experts(out, f"{prefix}.experts")  # the biases, and dense weights if there are some
            stack_experts(out, prefix, HF_EXPERT_NAMES, prefix, self.config.num_experts)  # a GGUF's split gate / up
            stack_gguf_expert_biases(out, f"{prefix}.experts")
            if load_mxfp4_experts(out, f"{prefix}.experts", experts):
                out[f"{prefix}.experts.gate_up_proj"] = experts.gate_up_proj
                out[f"{prefix}.experts.down_proj"] = experts.down_proj
        if mxfp4_bytes:
            log_dequantized_memory(self, mxfp4_bytes, self.config.name or self.config.architecture)
        return out

