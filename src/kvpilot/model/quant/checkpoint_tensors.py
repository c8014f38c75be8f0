"""Which tensors of a pre-quantized checkpoint are quantized linear layers, read into Int4Weight / Fp8Weight.

A module is quantized when its marker tensor is there (`qweight` for AWQ / GPTQ, `weight_packed` for
compressed-tensors 4-bit, an e4m3 `weight` with its scale for fp8): checkpoints name the layers they keep dense
(lm_head, MoE routers) only in tool-specific lists, while the tensors say it unambiguously. A layer's fp8 KV
cache scales are taken out first (take_kv_cache_scales, for model/kv_scales.py); the other activation scales
(static input scales, any k/v scale left) are dropped: kvpilot does not quantize activations from them.
"""

from __future__ import annotations

import logging
import re

import torch

from kvpilot.model.errors import ModelLoadError
from kvpilot.model.quant.checkpoint_scheme import CheckpointScheme, Fp8Scheme
from kvpilot.model.quant.fp8_checkpoint import FP8_DTYPE, Fp8Weight, read_fp8
from kvpilot.model.quant.int4_unpack import LAYOUT_TENSORS, read_int4
from kvpilot.model.quant.int4_weight import Int4Weight

logger = logging.getLogger("kvpilot")

QuantizedWeight = Int4Weight | Fp8Weight
UNUSED_SUFFIXES = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "k_scale", "v_scale",
                   "kv_scale", "q_scale", "prob_scale")


_KV_SCALE = re.compile(r"\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                       r"v_proj\.output_scale)$")


def take_kv_cache_scales(state: dict[str, torch.Tensor]) -> dict[int, tuple[float, float]]:
    """Removes a checkpoint's fp8 KV cache scales from `state` (vLLM's and llm-compressor's names: a layer's
    `self_attn.k_scale` / `v_scale`, one `kv_scale` for both, or `k_proj` / `v_proj.output_scale`); returns
    (k_scale, v_scale) per layer index, for layers that have both (stored = value / scale, as kvpilot's)."""
    found: dict[int, dict[str, float]] = {}
    for name, match in [(n, m) for n in state if (m := _KV_SCALE.search(n)) is not None]:
        kind = match[2].split(".")[0].replace("_proj", "_scale")  # k_proj.output_scale -> k_scale
        value = float(state.pop(name).float().max())
        for k in ("k_scale", "v_scale") if kind == "kv_scale" else (kind,):
            found.setdefault(int(match[1]), {})[k] = value
    return {layer: (s["k_scale"], s["v_scale"]) for layer, s in sorted(found.items())
            if "k_scale" in s and "v_scale" in s}


def take_quantized(state: dict[str, torch.Tensor], scheme: CheckpointScheme,
                   source: str) -> dict[str, QuantizedWeight]:
    """Removes every quantized module's tensors (and the unused activation scales) from `state`; returns the
    modules' weights by module name (the HF tensor names less `.qweight` etc.). ModelLoadError when a module
    lacks a tensor its layout needs, or fp8 weights come without scales."""
    dropped = [name for name in state if name.rsplit(".", 1)[-1] in UNUSED_SUFFIXES]
    for name in dropped:
        del state[name]
    if dropped:
        logger.info("%s: %d activation / KV-cache scales ignored (activations stay in the model dtype)", source,
                    len(dropped))
    if isinstance(scheme, Fp8Scheme):
        return _take_fp8(state, scheme, source)
    required, optional = LAYOUT_TENSORS[scheme.layout]
    marker = f".{required[0]}"
    weights: dict[str, QuantizedWeight] = {}
    for module in [name[: -len(marker)] for name in state if name.endswith(marker)]:
        missing = [s for s in required if f"{module}.{s}" not in state]
        if missing:
            raise ModelLoadError(f"{source}: {module} lacks {', '.join(missing)} ({scheme.method} layers have "
                                 f"{', '.join(required)})")
        tensors = {s: state.pop(f"{module}.{s}") for s in required + optional if f"{module}.{s}" in state}
        weights[module] = read_int4(tensors, scheme, f"{source}: {module}")
    if not weights:
        raise ModelLoadError(f"{source}: config.json declares {scheme.method} quantization but no tensor is named "
                             f"*{marker}")
    return weights


def _take_fp8(state: dict[str, torch.Tensor], scheme: Fp8Scheme, source: str) -> dict[str, QuantizedWeight]:
    weights: dict[str, QuantizedWeight] = {}
    for name in [n for n, t in state.items() if n.endswith(".weight") and t.dtype == FP8_DTYPE]:
        module = name[: -len(".weight")]
        scale = f"{module}.{scheme.scale_name}"
        if scale not in state:
            raise ModelLoadError(f"{source}: fp8 weight {name} has no {scheme.scale_name}")
        tensors = {"weight": state.pop(name), scheme.scale_name: state.pop(scale)}
        weights[module] = read_fp8(tensors, scheme, f"{source}: {module}")
    if not weights:
        raise ModelLoadError(f"{source}: config.json declares {scheme.method} fp8 quantization but no weight is "
                             "float8_e4m3fn")
    return weights
