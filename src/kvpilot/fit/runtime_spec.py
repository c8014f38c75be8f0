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


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as the config states it (Llama-3 style fields; defaults are Llama-3's).
    Invariant: rope_type is not "default" (plain RoPE is `rope_scaling=None`)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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


def _rope(cfg: dict[str, Any], name: str) -> tuple[float, RopeScaling | None]:
    """Rope base and scaling from either the transformers 4.x (`rope_theta`, `rope_scaling`) or 5.x
    (`rope_parameters`) layout."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", DEFAULT_ROPE_THETA)))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type") not in (None, "default") else None)
    if not scaling:
        return theta, None
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type == "default":
        return theta, None
    if scaling.get("factor") is None:
        raise ConfigError(f"{name}: rope scaling '{rope_type}' has no 'factor'.")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


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
    )
