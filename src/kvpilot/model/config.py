"""ModelConfig: the one in-memory description of a Llama-family model, whatever it was loaded from.

Torch-free, so the scheduler layer and `fit` can read it. Built from a Hugging Face config dict
(`from_hf_config`); GGUF metadata and the built-in catalog are first turned into such a dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpilot.model.errors import ModelLoadError

# HF `architectures[0]` -> (family, has qkv bias by default, has q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type "llama3"); other types are rejected at load."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder-only Llama-family model.

    Invariants: num_attention_heads % num_key_value_heads == 0; head_dim is even (RoPE rotates pairs).
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
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
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

    def num_parameters(self) -> int:
        """Parameter count implied by the config (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + lm_head


def _require(cfg: dict[str, Any], key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ModelLoadError(f"{source}: the model config has no '{key}'; is this a complete config.json?")
    return cfg[key]


def _rope_scaling(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """Reads rope theta and scaling from either the transformers 4.x or 5.x layout."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type") not in (None, "default") else None)
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(f"{source}: rope scaling type '{rope_type}' is not supported (supported: llama3)")
    return theta, RopeScaling(
        rope_type="llama3",
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def from_hf_config(cfg: dict[str, Any], source: str = "config") -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face config.json dict; `source` names it in errors."""
    architectures = cfg.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ModelLoadError(f"{source}: unsupported architecture {arch!r}; kvpilot supports {supported}")
    family, default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
    hidden = int(_require(cfg, "hidden_size", source))
    heads = int(_require(cfg, "num_attention_heads", source))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads != 0:
        raise ModelLoadError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads})")
    if head_dim % 2 != 0:
        raise ModelLoadError(f"{source}: head_dim ({head_dim}) must be even for rotary embeddings")
    theta, scaling = _rope_scaling(cfg, source)
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=int(_require(cfg, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", source)),
        num_hidden_layers=int(_require(cfg, "num_hidden_layers", source)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", default_bias)),
        qk_norm=qk_norm,
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        name=str(cfg.get("_name_or_path", "")),
        extra=dict(cfg),
    )
