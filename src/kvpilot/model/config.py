"""ModelConfig: the one in-memory description of a decoder model of any registered family, whatever it was
loaded from.

Torch-free. Built from a Hugging Face config dict (`from_hf_config`); GGUF metadata and the built-in catalog
are first turned into such a dict. The dict is parsed by kvpilot.fit's parser (ModelSpec for the shapes,
RuntimeSpec for rope, norms and token ids), the same one `kvpilot fit` plans with; this module only checks
what the engine can run and assembles the result. Facts only one family uses (Gemma's soft-capping, say)
stay in `extra` (the raw config) and are read by that family's module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kvpilot.engine.kv_groups import KVGroupPlan, plan_kv_groups
from kvpilot.fit.model_spec import ModelSpec, layer_types, spec_from_hf_config, text_config
from kvpilot.fit.runtime_spec import RopeScaling, RuntimeSpec, runtime_spec_from_hf_config
from kvpilot.model.errors import ModelLoadError, config_errors_as_load_errors
from kvpilot.model.models.registry import family_for_architecture, unsupported_message

__all__ = ["ModelConfig", "RopeScaling", "from_hf_config", "unsupported_reason"]

# Checked before parsing, in this order: the engine has no default for any of them.
REQUIRED_KEYS = ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size", "num_hidden_layers")
SUPPORTED_ROPE_SCALING = ("llama3", "linear", "dynamic", "yarn", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder-only Llama-family model.

    Invariants: num_attention_heads % num_key_value_heads == 0; head_dim and rotary_dim are even (RoPE rotates
    pairs).
    """

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # the longest context the model runs: the config's max_position_embeddings, stretched by the RoPE scaling
    # where the config states the pre-scaling length (RopeScaling.context_length; the default max_model_len)
    max_position_embeddings: int = 4096
    partial_rotary_factor: float = 1.0  # RoPE rotates the first rotary_dim of each head, the rest passes
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # each layer's attention: "full_attention" or "sliding_attention" (the latter over `sliding_window`)
    layer_types: tuple[str, ...] = ()
    # mixture of experts (0: a dense MLP): experts per MoE layer, experts each token uses, an expert's width
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`; None when it attends to the whole context."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def kv_group_plan(self, hybrid: bool = True) -> KVGroupPlan:
        """How the layers share the KV pool (engine/kv_groups.py): several groups for an interleaved model
        unless hybrid is False."""
        return plan_kv_groups([self.layer_window(i) for i in range(self.num_hidden_layers)], hybrid=hybrid)

    @cached_property
    def _hybrid_groups(self) -> tuple[int, ...]:
        """Each layer's group under kv_group_plan(): computed once, not once a layer."""
        return self.kv_group_plan().layer_groups

    def layer_kv_group(self, layer: int) -> int:
        """The KV group layer `layer` reads its block table from when the engine gives the model several (its
        LayerAttention.kv_group; a one-group engine ignores it)."""
        return self._hybrid_groups[layer]


def _family(arch: str | None, source: str) -> str:
    """The registry's family name, which is also the parser's model_type (so Qwen2's qkv bias and Qwen3's
    q/k RMSNorm follow the architecture)."""
    family = family_for_architecture(arch)
    if family is None:
        raise ModelLoadError(unsupported_message(arch, source))
    return family.name


def _check_required(cfg: dict[str, Any], source: str) -> None:
    for key in REQUIRED_KEYS:
        if cfg.get(key) is None:
            raise ModelLoadError(f"{source}: the model config has no '{key}'; is this a complete config.json?")


def _check_runnable(spec: ModelSpec, runtime: RuntimeSpec, source: str) -> None:
    """What the engine implements on top of what the parser accepts."""
    if spec.head_dim % 2 != 0:
        raise ModelLoadError(f"{source}: head_dim ({spec.head_dim}) must be even for rotary embeddings")
    rotary_dim = int(spec.head_dim * runtime.partial_rotary_factor)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > spec.head_dim:
        raise ModelLoadError(f"{source}: partial_rotary_factor {runtime.partial_rotary_factor} rotates {rotary_dim} "
                             f"of head_dim {spec.head_dim}; it must rotate an even number of dimensions, at most all")
    scaling = runtime.rope_scaling
    if scaling is not None and scaling.rope_type not in SUPPORTED_ROPE_SCALING:
        raise ModelLoadError(f"{source}: rope scaling type '{scaling.rope_type}' is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_SCALING)})")
    if scaling is not None and scaling.rope_type == "longrope" and len(scaling.short_factor) != rotary_dim // 2:
        raise ModelLoadError(f"{source}: longrope short_factor/long_factor have {len(scaling.short_factor)} entries; "
                             f"the model rotates {rotary_dim // 2} dimension pairs per head")


def from_hf_config(cfg: dict[str, Any], source: str = "config") -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face config.json dict; `source` names it in errors (ModelLoadError)."""
    with config_errors_as_load_errors(source):
        runtime = runtime_spec_from_hf_config(cfg, source)
    family = _family(runtime.architecture, source)
    _check_required(cfg, source)
    with config_errors_as_load_errors(source):
        spec = spec_from_hf_config({**cfg, "model_type": family}, source)
    _check_runnable(spec, runtime, source)
    with config_errors_as_load_errors(source):
        types = layer_types({**text_config(cfg), "model_type": family}, spec.num_hidden_layers)
    moe = spec.moe
    return ModelConfig(
        architecture=str(runtime.architecture),  # supported, so not None
        family=family,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=runtime.rms_norm_eps,
        rope_theta=runtime.rope_theta,
        rope_scaling=runtime.rope_scaling,
        max_position_embeddings=(runtime.rope_scaling.context_length(spec.max_position_embeddings, family)
                                 if runtime.rope_scaling else spec.max_position_embeddings),
        partial_rotary_factor=runtime.partial_rotary_factor,
        tie_word_embeddings=spec.tie_word_embeddings,
        attention_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm,
        sliding_window=spec.sliding_window,
        layer_types=types,
        num_experts=moe.num_experts if moe else 0,
        num_experts_per_tok=moe.num_experts_per_tok if moe else 0,
        moe_intermediate_size=moe.expert_intermediate_size if moe else 0,
        bos_token_id=runtime.bos_token_id,
        eos_token_ids=runtime.eos_token_ids,
        torch_dtype=spec.torch_dtype,
        name=runtime.name_or_path,
        extra=dict(cfg),
    )


def unsupported_reason(cfg: dict[str, Any]) -> str | None:
    """None when the engine runs the model `cfg` describes, else the load error it would raise."""
    try:
        from_hf_config(cfg, str(cfg.get("_name_or_path") or "model"))
    except ModelLoadError as exc:
        return str(exc)
    return None
