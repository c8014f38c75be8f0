"""ModelSpec: the architecture facts the planner needs, parsed from an HF-style config dict.

Supported shapes: dense decoder-only transformers (Llama, Mistral, Qwen2/3, Gemma-2), Mixture-of-Experts
(Mixtral, Qwen3-MoE, DeepSeek-V3) and Multi-head Latent Attention (DeepSeek-V2/V3).

With `runtime_spec` this is kvpilot's one HF-config parser: the model loader builds its ModelConfig from a
ModelSpec and a RuntimeSpec (it only checks which keys the engine requires and what the engine can run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.fit.errors import ConfigError

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Qwen2's attention has q/k/v biases although its config.json has no `attention_bias` key.
_QKV_BIAS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe"})
# Qwen3 normalises q and k per head (q_norm, k_norm weights of size head_dim in every layer).
_QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})
# Gemma-2 has pre- and post-norms around both attention and MLP: 4 norm vectors per layer.
_FOUR_NORM_MODEL_TYPES = frozenset({"gemma2", "gemma3_text"})
# Gemma's config class ties embeddings by default and its config.json omits the key.
_TIED_BY_DEFAULT_MODEL_TYPES = frozenset({"gemma", "gemma2", "gemma3_text"})


@dataclass(frozen=True)
class MoeDims:
    """Mixture-of-Experts FFN. Invariant: 0 < num_experts_per_tok <= num_experts."""

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    num_shared_experts: int
    # layers that keep a dense FFN: DeepSeek's first_k_dense_replace, Qwen-MoE's mlp_only_layers and the layers
    # between every decoder_sparse_step-th one
    num_dense_layers: int
    has_router_bias: bool  # DeepSeek-V3's e_score_correction_bias, gpt-oss's router bias (one float per expert)
    has_expert_bias: bool = False  # gpt-oss: every expert's gate, up and down projections have biases


@dataclass(frozen=True)
class MlaDims:
    """Multi-head Latent Attention (DeepSeek-V2/V3): the KV cache stores one compressed latent."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one model. Invariant: all counts are positive; num_key_value_heads divides
    num_attention_heads; 0 <= num_sliding_layers <= num_hidden_layers."""

    name: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per query head and layer
    norms_per_layer: int = 2
    moe: MoeDims | None = None
    mla: MlaDims | None = None
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    checkpoint_quantization: str | None = None  # quantization_config.quant_method, e.g. "fp8"

    @property
    def is_moe(self) -> bool:
        return self.moe is not None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: multimodal configs nest it under `text_config` (merged over the top)."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def _int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key)
    value = default if value is None else value  # some configs write null for "use the default"
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"config field '{key}' must be a positive number, got {value!r}.")
    return int(value)


def _moe_dims(cfg: dict[str, Any], num_hidden_layers: int) -> MoeDims | None:
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if not num_experts:
        return None
    top_k = _int(cfg, "num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok={top_k} exceeds the {num_experts} experts.")
    return MoeDims(
        num_experts=int(num_experts),
        num_experts_per_tok=top_k,
        expert_intermediate_size=_int(cfg, "moe_intermediate_size", cfg.get("intermediate_size")),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_dense_layers=_num_dense_layers(cfg, num_hidden_layers),
        has_router_bias=cfg.get("topk_method") == "noaux_tc" or cfg.get("model_type") == "gpt_oss",
        has_expert_bias=cfg.get("model_type") == "gpt_oss",
    )


def _num_dense_layers(cfg: dict[str, Any], num_hidden_layers: int) -> int:
    """Layers with a dense FFN, as transformers picks them: before first_k_dense_replace (DeepSeek), listed in
    mlp_only_layers, or with (i + 1) not a multiple of decoder_sparse_step (Qwen-MoE) or i not a multiple of
    moe_layer_freq (DeepSeek)."""
    first_moe = int(cfg.get("first_k_dense_replace") or 0)
    dense_only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    step, freq = int(cfg.get("decoder_sparse_step") or 1), int(cfg.get("moe_layer_freq") or 1)
    return sum(1 for i in range(num_hidden_layers)
               if i < first_moe or i in dense_only or (i + 1) % step or i % freq)


def _mla_dims(cfg: dict[str, Any]) -> MlaDims | None:
    if not cfg.get("kv_lora_rank"):
        return None
    return MlaDims(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=_int(cfg, "kv_lora_rank"),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim"),
        v_head_dim=_int(cfg, "v_head_dim"),
    )


def layer_types(cfg: dict[str, Any], num_hidden_layers: int) -> tuple[str, ...]:
    """Each layer's attention, "full_attention" or "sliding_attention", as HF builds it: the config's own
    `layer_types` list when it has one, else the family's pattern. Qwen configs carry a window but disable
    it (`use_sliding_window: false`); Qwen2 slides only from `max_window_layers` on."""
    full = ("full_attention",) * num_hidden_layers
    if not cfg.get("sliding_window") or cfg.get("use_sliding_window") is False:
        return full
    listed = cfg.get("layer_types")
    if isinstance(listed, list) and listed:
        if len(listed) != num_hidden_layers:
            raise ConfigError(f"layer_types has {len(listed)} entries for {num_hidden_layers} layers.")
        return tuple(str(t) for t in listed)
    model_type = cfg.get("model_type")
    if model_type in ("gemma2", "gpt_oss"):  # even layers slide, odd layers are global
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_hidden_layers))
    pattern = cfg.get("sliding_window_pattern") or (6 if model_type == "gemma3_text" else None)
    if pattern:  # Gemma 3: every pattern-th layer is global
        return tuple("full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
                     for i in range(num_hidden_layers))
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        first = int(cfg.get("max_window_layers") or 0)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_hidden_layers))
    return ("sliding_attention",) * num_hidden_layers


def _num_sliding_layers(cfg: dict[str, Any], num_hidden_layers: int) -> tuple[int | None, int]:
    """(window, number of layers using it); (None, 0) when no layer slides."""
    num_sliding = sum(1 for t in layer_types(cfg, num_hidden_layers) if t == "sliding_attention")
    return (int(cfg["sliding_window"]), num_sliding) if num_sliding else (None, 0)


def _quant_method(cfg: dict[str, Any]) -> str | None:
    quant = cfg.get("quantization_config")
    return str(quant.get("quant_method")) if isinstance(quant, dict) and quant.get("quant_method") else None


def spec_from_hf_config(config: dict[str, Any], name: str = "model") -> ModelSpec:
    """Parse an HF config.json dict. Raises ConfigError naming the missing or bad field."""
    if not isinstance(config, dict):
        raise ConfigError(f"{name}: a config must be a JSON object, got {type(config).__name__}.")
    cfg = text_config(config)
    missing = [key for key in _REQUIRED if key not in cfg]
    if missing:
        raise ConfigError(f"{name}: config lacks {', '.join(missing)}; is this an LLM config.json?")
    hidden, num_hidden_layers = _int(cfg, "hidden_size"), _int(cfg, "num_hidden_layers")
    num_heads = _int(cfg, "num_attention_heads")
    num_key_value_heads = _int(cfg, "num_key_value_heads", num_heads)
    if num_heads % num_key_value_heads:
        raise ConfigError(f"{name}: num_key_value_heads={num_key_value_heads} does not divide {num_heads} heads.")
    model_type = str(cfg.get("model_type", "llama"))
    window, num_sliding = _num_sliding_layers(cfg, num_hidden_layers)
    return ModelSpec(
        name=name,
        model_type=model_type,
        hidden_size=hidden,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        intermediate_size=_int(cfg, "intermediate_size", 4 * hidden),
        vocab_size=_int(cfg, "vocab_size"),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(
            cfg.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT_MODEL_TYPES)
        ),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        qkv_bias=bool(cfg.get("attention_bias")) or model_type in _QKV_BIAS_MODEL_TYPES,
        o_bias=bool(cfg.get("attention_bias")) and model_type not in _QKV_BIAS_MODEL_TYPES,
        qk_norm=model_type in _QK_NORM_MODEL_TYPES,
        attention_sinks=model_type == "gpt_oss",
        norms_per_layer=4 if model_type in _FOUR_NORM_MODEL_TYPES else 2,
        moe=_moe_dims(cfg, num_hidden_layers),
        mla=_mla_dims(cfg),
        sliding_window=window,
        num_sliding_layers=num_sliding,
        checkpoint_quantization=_quant_method(cfg),
    )
