"""RuntimeSpec: what running a model needs from its HF config beyond the shapes in ModelSpec.

The second half of kvpilot's one HF-config parser (`model_spec.spec_from_hf_config` is the first): norm
epsilon, RoPE base and scaling, special token ids. The planner does not need these; the model loader builds
its ModelConfig from a ModelSpec plus a RuntimeSpec. Torch-free. Any RoPE scaling type is parsed here;
which types the engine implements is the engine's check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.fit.errors import ConfigError
from kvpilot.fit.model_spec import text_config

DEFAULT_RMS_NORM_EPS = 1e-6
DEFAULT_ROPE_THETA = 10000.0


# model types whose max_position_embeddings is already the scaled context, whatever the scaling type
STATES_SCALED_LENGTH = frozenset({"gemma3", "gemma3_text"})


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as the config states it: one record for every type, each type reading its own
    fields (the others keep their defaults). The frequencies themselves are the engine's
    (kvpilot.model.layers.rope_scaling).

    Invariants: rope_type is not "default" (plain RoPE is `rope_scaling=None`); `factor` is set (for
    "longrope" without one: max_position_embeddings / original_max_position_embeddings, as HF derives it);
    `original_max_position_embeddings` is the length the model was trained at before scaling (for "dynamic"
    and "linear", which HF gives none: the config's max_position_embeddings); "longrope" has
    `short_factor` and `long_factor`, of equal length.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    # yarn, longrope: the factor cos and sin are multiplied by; None: the type's default from `factor`
    attention_factor: float | None = None
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn, DeepSeek style: the attention factor's ratio of two mscales
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions (gpt-oss: False)
    short_factor: tuple[float, ...] = ()  # longrope: per rotary pair, below original_max_position_embeddings
    long_factor: tuple[float, ...] = ()  # longrope: from original_max_position_embeddings on

    def context_length(self, max_position_embeddings: int, model_type: str | None = None) -> int:
        """The longest context the scaled model supports. llama3 and longrope configs state it as
        max_position_embeddings already, and so do Gemma 3's (131,072 with linear factor 8 on its global
        layers); other linear and dynamic configs stretch the config's length by `factor`; yarn configs do
        either (Qwen3 keeps the pre-scaling length, gpt-oss and DeepSeek state the scaled one)."""
        if model_type in STATES_SCALED_LENGTH:
            return max_position_embeddings
        if self.rope_type in ("linear", "dynamic"):
            return int(max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        return max_position_embeddings


@dataclass(frozen=True)
class RuntimeSpec:
    """The config's run-time facts. `architecture` is the top-level `architectures[0]` (None if absent);
    `eos_token_ids` holds every id that ends generation (may be empty); `name_or_path` is '' if absent."""

    architecture: str | None
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    name_or_path: str
    partial_rotary_factor: float = 1.0  # the leading fraction of each head RoPE rotates (Phi-4-mini: 0.75)


# older names HF still reads for a rope type (the first Phi-3 configs said "su")
_ROPE_TYPE_ALIASES = {"su": "longrope"}
# the types HF gives a pre-scaling length; a top-level `original_max_position_embeddings` (Phi-3) wins
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")


def _rope(cfg: dict[str, Any], name: str) -> tuple[float, RopeScaling | None]:
    """Rope base and scaling from either the transformers 4.x (`rope_theta`, `rope_scaling`) or 5.x
    (`rope_parameters`) layout; a 5.x dict per layer type (Gemma 3) gives its global layers' RoPE."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    theta = float(cfg.get("rope_theta", params.get("rope_theta", DEFAULT_ROPE_THETA)))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type") not in (None, "default") else None)
    if not scaling:
        return theta, None
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type == "default":
        return theta, None
    return theta, _scaling(rope_type, scaling, cfg, name)


def _float_list(scaling: dict[str, Any], key: str, name: str) -> tuple[float, ...]:
    value = scaling.get(key) or ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, float)) for v in value):
        raise ConfigError(f"{name}: rope scaling '{key}' must be a list of numbers.")
    return tuple(float(v) for v in value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _scaling(rope_type: str, scaling: dict[str, Any], cfg: dict[str, Any], name: str) -> RopeScaling:
    """The fields of a scaling dict, with HF's defaults (see RopeScaling's invariants)."""
    max_positions = int(cfg.get("max_position_embeddings") or 4096)
    original = max_positions
    if rope_type in _ORIGINAL_LENGTH_TYPES:
        original = int(cfg.get("original_max_position_embeddings")
                       or scaling.get("original_max_position_embeddings") or max_positions)
    factor = scaling.get("factor")
    if factor is None and rope_type == "longrope":
        factor = max_positions / original
    if factor is None:
        raise ConfigError(f"{name}: rope scaling '{rope_type}' has no 'factor'.")
    short, long = _float_list(scaling, "short_factor", name), _float_list(scaling, "long_factor", name)
    if rope_type == "longrope" and (not short or len(short) != len(long)):
        raise ConfigError(f"{name}: longrope scaling needs 'short_factor' and 'long_factor' lists of equal "
                          "length (one number per rotary pair).")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        attention_factor=_optional_float(scaling.get("attention_factor")),
        beta_fast=float(scaling.get("beta_fast") or 32.0),  # HF: a 0 or null takes the default too
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=_optional_float(scaling.get("mscale")),
        mscale_all_dim=_optional_float(scaling.get("mscale_all_dim")),
        truncate=bool(scaling.get("truncate", True)),
        short_factor=short,
        long_factor=long,
    )


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """The fraction of each head that rotates: the rope dict's value first, then the config's (as HF)."""
    for source in (cfg.get("rope_parameters"), cfg.get("rope_scaling"), cfg):
        if isinstance(source, dict) and source.get("partial_rotary_factor") is not None:
            return float(source["partial_rotary_factor"])
    return 1.0


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def runtime_spec_from_hf_config(config: dict[str, Any], name: str = "model") -> RuntimeSpec:
    """Parse the run-time fields of an HF config.json dict; `name` names it in errors (ConfigError)."""
    if not isinstance(config, dict):
        raise ConfigError(f"{name}: a config must be a JSON object, got {type(config).__name__}.")
    cfg = text_config(config)
    architectures = config.get("architectures") or []
    theta, scaling = _rope(cfg, name)
    bos = cfg.get("bos_token_id")
    return RuntimeSpec(
        architecture=str(architectures[0]) if architectures else None,
        rms_norm_eps=float(cfg.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS)),
        rope_theta=theta,
        rope_scaling=scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        name_or_path=str(cfg.get("_name_or_path", "")),
        partial_rotary_factor=_partial_rotary_factor(cfg),
    )
