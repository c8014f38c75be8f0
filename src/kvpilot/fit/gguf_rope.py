"""A GGUF's RoPE facts as HF config keys: partial rotary, linear and YaRN scaling, and Phi-3's LongRoPE, read as
llama.cpp's convert_hf_to_gguf.py writes them; what kvpilot cannot map exactly is refused.

Torch-free (the planner reads GGUF headers too). llama.cpp writes:
- `{arch}.rope.dimension_count`: the rotated dimensions of a head (fewer than head_dim: partial rotary);
- `{arch}.rope.scaling.type` "linear" or "yarn" with `.factor` and `.original_context_length`, YaRN's
  `.yarn_beta_fast` / `.yarn_beta_slow` where the HF config had them;
- for Phi-3 (no scaling type): the LongRoPE factors as the tensors `rope_factors_short.weight` and
  `rope_factors_long.weight`, the pre-scaling length as `.original_context_length` and the attention factor
  as `.attn_factor`;
- Llama 3.1's scaling as a `rope_freqs.weight` tensor: not mapped back (refused).

YaRN variants whose llama.cpp magnitude terms differ from HF's attention_factor (`.attn_factor`,
`.yarn_attn_factor`, `.yarn_log_multiplier`, `.yarn_ext_factor` away from their neutral values) are refused
rather than run with a silently different scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvpilot.fit.errors import GgufError

# YaRN magnitude keys and the value at which llama.cpp's YaRN equals HF's with the default attention factor
_NEUTRAL_YARN_KEYS = {"rope.scaling.attn_factor": 1.0, "rope.scaling.yarn_attn_factor": 1.0,
                      "rope.scaling.yarn_log_multiplier": 0.0, "rope.scaling.yarn_ext_factor": 1.0}


def _longrope(key: Callable[[str], Any], tensors: dict[str, Any], cfg: dict[str, Any],
              path: Path) -> dict[str, Any]:
    """Phi-3's rope_scaling from the factor tensors; attention_factor only where it is not HF's default."""
    original = key("rope.scaling.original_context_length")
    if original is None:
        raise GgufError(f"{path}: GGUF LongRoPE factors without 'rope.scaling.original_context_length'")
    scaling: dict[str, Any] = {
        "rope_type": "longrope", "original_max_position_embeddings": int(original),
        "short_factor": np.asarray(tensors["rope_factors_short.weight"].data, dtype=np.float32).tolist(),
        "long_factor": np.asarray(tensors["rope_factors_long.weight"].data, dtype=np.float32).tolist()}
    stored = key("rope.scaling.attn_factor")
    factor = cfg["max_position_embeddings"] / int(original)
    default = math.sqrt(1 + math.log(factor) / math.log(int(original))) if factor > 1 else 1.0
    if stored is not None and np.float32(stored) != np.float32(default):  # the file rounded it to float32
        scaling["attention_factor"] = float(stored)
    return {"rope_scaling": scaling}


def _yarn_or_linear(kind: str, key: Callable[[str], Any], path: Path) -> dict[str, Any]:
    factor = key("rope.scaling.factor")
    if not factor:
        raise GgufError(f"{path}: GGUF rope scaling '{kind}' has no 'rope.scaling.factor'")
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
    odd = [name for name, neutral in _NEUTRAL_YARN_KEYS.items()
           if key(name) is not None and not math.isclose(float(key(name)), neutral)]
    if odd:
        raise GgufError(f"{path}: GGUF YaRN with {', '.join(odd)} set is not supported yet; use the HF "
                        "checkpoint instead")
    scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
    original = key("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                             ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if key(gguf_key) is not None:
            scaling[hf_key] = float(key(gguf_key))
    return {"rope_scaling": scaling}


def gguf_rope_fields(key: Callable[[str], Any], tensors: dict[str, Any], cfg: dict[str, Any],
                     path: Path) -> dict[str, Any]:
    """HF config keys for the RoPE of a GGUF whose metadata `key(name)` reads (`{arch}.name`, None if absent)
    and whose tensors by name are `tensors`; `cfg` holds the sizes already read (head_dim,
    max_position_embeddings). Raises GgufError for scaling kvpilot does not map."""
    fields: dict[str, Any] = {}
    rotated = key("rope.dimension_count")
    if rotated and int(rotated) != cfg["head_dim"]:
        fields["partial_rotary_factor"] = int(rotated) / cfg["head_dim"]
    kind = key("rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        raise GgufError(f"{path}: GGUF rope scaling as a rope_freqs tensor (Llama 3.1 style) is not supported "
                        "yet; use the HF checkpoint instead")
    if "rope_factors_long.weight" in tensors and kind in (None, "none", "longrope"):
        return {**fields, **_longrope(key, tensors, cfg, path)}
    if kind in ("linear", "yarn"):
        return {**fields, **_yarn_or_linear(kind, key, path)}
    if kind not in (None, "none"):
        raise GgufError(f"{path}: GGUF rope scaling '{kind}' is not supported (kvpilot maps linear and yarn, "
                        "and Phi-3's LongRoPE factors)")
    return fields
