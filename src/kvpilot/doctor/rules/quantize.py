"""decode-bound's "quantize the weights" fix: a weight format the running server can load, and what it saves.

Decode reads every weight once a step, so narrower weights are fewer bytes a token. The target per engine (bits a
weight as that engine holds it; kvpilot's from kvpilot.fit.gguf_holding and checkpoint_formats):
- kvpilot on a CPU: packed 4-bit blocks, Q4_1 with `--quantization int4` (5.0 bits, quantized at load), or a GGUF of a
  type it runs packed (Q4_0 4.5, Q4_K_M about 4.9 in the file). Never fp8 there: a CPU dequantizes fp8 at load.
- kvpilot on a GPU: `--quantization fp8` (8 bits, quantized at load) from 16-bit weights, an AWQ or GPTQ int4
  checkpoint (4 bits + a 16-bit scale and a 4-bit zero per 128: 4.16) from 8-bit ones. Never a GGUF: kvpilot
  dequantizes GGUF weights on GPUs.
- vLLM: `--quantization fp8` from 16-bit weights; an AWQ / GPTQ int4 checkpoint (vLLM reads its
  quantization_config and runs awq_marlin / gptq_marlin) from 8-bit ones.
- llama.cpp: a GGUF type, Q4_K_M (about 4.9 bits a weight: llama.cpp's mix, kvpilot.fit.gguf_mixes).
- SGLang, TGI: the vLLM line, translated flag by flag (engine_flags.py).
The weights' current width is what the server reports (kvpilot's capacity endpoint: `weight_bits`), else taken as
16 bits and said so. A fix needs the target to save at least MIN_SAVED_BITS a weight: weights of 4-6 bits are about
as narrow as these engines go. The bytes saved a token are the model's linear weights (fit's count for --model, or the
model the server names) times the bits saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from kvpilot.doctor.engines import KVPILOT, LLAMACPP, VLLM
from kvpilot.doctor.findings import Fix
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.fit.errors import FitError
from kvpilot.fit.model_source import load_model

MIN_SAVED_BITS = 1.5
UNREPORTED_BITS = 16.0  # bf16 checkpoints, the common case when the server does not say
INT4_CHECKPOINT_BITS = 4 + 20 / 128  # AWQ / GPTQ group 128: 16-bit scale + 4-bit zero per group
Q4_K_M_BITS = 4.9  # llama.cpp's Q4_K_M mix on 7-8B models (kvpilot.fit.gguf_mixes computes it per model)
INT4_CHECKPOINT = "an AWQ or GPTQ int4 checkpoint"


@dataclass(frozen=True)
class _Target:
    """One format the server loads: its width, and how to ask for it (flags; "" where that engine has none)."""

    name: str
    bits: float
    kvpilot: str = ""
    vllm: str = ""


def _targets(engine: str | None, device: str | None, bits: float) -> list[_Target]:
    """Formats narrower than `bits` that `engine` on `device` ("cpu", a GPU name, None: unknown) loads."""
    int4_checkpoint = _Target(f"{INT4_CHECKPOINT} ({INT4_CHECKPOINT_BITS:.2f} bits)", INT4_CHECKPOINT_BITS,
                              f"--model <{INT4_CHECKPOINT}>", f"--model <{INT4_CHECKPOINT}>")
    if engine == LLAMACPP:
        return [_Target(f"a Q4_K_M GGUF (about {Q4_K_M_BITS} bits)", Q4_K_M_BITS)]
    if engine == KVPILOT and device == "cpu":
        return [_Target("packed 4-bit blocks (Q4_1, 5 bits; a Q4_0 or Q4_K_M GGUF runs packed too)", 5.0,
                        "--quantization int4")]
    fp8 = _Target("fp8 (8 bits)", 8.0, "--quantization fp8" if engine == KVPILOT and device else
                  "--quantization fp8 (GPU) or int4 (CPU)", "--quantization fp8")
    if engine == KVPILOT and device is None:  # kvpilot, device not told: the flag for each
        return [fp8]
    return [fp8, int4_checkpoint] if engine in (KVPILOT, VLLM) else [fp8]


@cache
def _num_linear_weights(model: str) -> int | None:
    """The model's decoder matrices and output head, as fit counts them (None: fit cannot place it)."""
    try:
        params = load_model(model).params
    except (FitError, OSError):
        return None
    return params.num_linear_total + (params.num_lm_head or params.num_embedding)


def _model_name(ctx: RuleContext) -> str | None:
    roof = ctx.inputs.verdict_roofline
    cfg = ctx.inputs.server_config
    return roof.model if roof is not None else (cfg.fit_model if cfg is not None else None)


def _saved_text(ctx: RuleContext, bits: float, target: _Target) -> str:
    saved = 1 - target.bits / bits
    name = _model_name(ctx)
    count = _num_linear_weights(name) if name else None
    size = f" (about {count * (bits - target.bits) / 8 / 1e9:,.2f} GB less a token for {name})" if count else ""
    return f"{saved:.0%} fewer weight bytes a token{size}"


def quantize_fix(ctx: RuleContext) -> Fix | None:
    """The fix for the running engine, or None when no format it loads saves MIN_SAVED_BITS a weight."""
    cfg = ctx.inputs.server_config
    reported = cfg.weight_bits if cfg is not None else None
    bits = reported or UNREPORTED_BITS
    engine = ctx.inputs.engine
    device = cfg.fit_device if cfg is not None else None
    targets = [t for t in _targets(engine, device, bits) if bits - t.bits >= MIN_SAVED_BITS]
    if not targets:
        return None
    target = targets[0]
    now = f"the weights take {bits:g} bits each" if reported else \
        f"if the weights are {UNREPORTED_BITS:g}-bit (the server does not say)"
    return Fix(f"read fewer bytes per token: {now}; {target.name}: {_saved_text(ctx, bits, target)}",
               kvpilot=target.kvpilot, vllm=target.vllm)
