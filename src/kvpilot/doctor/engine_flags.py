"""Fixes as flags of the engine that runs: SGLang's, llama-server's and TGI's names for vLLM's flags.

Rules write each fix for kvpilot and vLLM (kvpilot takes vLLM's names). For a server of another engine, the
fix's vLLM flags are translated here, flag by flag, and printed as that engine's line. A fix with a flag that
engine has no counterpart for (or text that is not plain flags) gets no line: the action still says what to
do. Every target flag was checked against the engine's own flag list: SGLang's server arguments
(``--max-running-requests``, ``--context-length``, ``--chunked-prefill-size``, ``--disable-radix-cache``,
``--kv-cache-dtype``, ``--tp-size``, ``--dp-size``, ``--mem-fraction-static``, ``--quantization``),
``llama-server --help`` (``--parallel``, ``--ctx-size``, ``--batch-size``, ``--cache-prompt``,
``--cache-type-k``/``-v``) and ``text-generation-launcher --help`` (``--max-batch-size``, ``--max-total-tokens``,
``--max-batch-prefill-tokens``, ``--num-shard``, ``--quantize``).

Speculation (``--speculative-config '{"method": "ngram", "num_speculative_tokens": k, ...}'``): SGLang's
``--speculative-algorithm NGRAM --speculative-num-draft-tokens k`` (its speculative-decoding docs),
llama-server's ``--spec-type ngram-simple --draft-max k`` (its docs/speculative.md) and TGI's ``--speculate k``
(n-gram speculation when the model has no Medusa heads). None of them has vLLM's ``disable_by_batch_size``,
so a fix that sets it gets no line there.

llama-server splits ``--ctx-size`` over its ``--parallel`` slots, so more slots need a larger context to keep
each slot's: the translation multiplies by the per-slot context its ``/props`` reported.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

from kvpilot.doctor.current_settings import plain_flags
from kvpilot.doctor.engines import LLAMACPP, SGLANG, TGI
from kvpilot.doctor.findings import Finding, Fix
from kvpilot.doctor.server_config import ServerConfig

Translate = Callable[[str | None, ServerConfig | None], str]


def _to(flag: str) -> Translate:
    """The same setting under another name, the value carried over."""
    return lambda value, _cfg: f"{flag} {value}" if value is not None else flag


def _text(text: str) -> Translate:
    return lambda _value, _cfg: text


def _llamacpp_slots(value: str | None, cfg: ServerConfig | None) -> str:
    per_slot = cfg.max_model_len if cfg is not None else None
    if value is None or not value.isdigit():
        return "--parallel <slots>"
    return (f"--parallel {value} --ctx-size {int(value) * per_slot}" if per_slot else
            f"--parallel {value} (and --ctx-size {value} x one slot's context)")


def _llamacpp_context(value: str | None, cfg: ServerConfig | None) -> str:
    slots = cfg.max_num_seqs if cfg is not None else None
    if value is None or not value.isdigit():
        return "--ctx-size <slots x context>"
    return f"--ctx-size {int(value) * slots}" if slots else f"--ctx-size {value} x --parallel"


def _speculation(template: str) -> Translate:
    """An n-gram ``--speculative-config`` as ``template`` filled with its num_speculative_tokens ("" for
    another method or a field the engine has no flag for)."""
    def translate(value: str | None, _cfg: ServerConfig | None) -> str:
        try:
            config = json.loads(value or "")
        except json.JSONDecodeError:
            return ""
        extra = set(config) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"} \
            if isinstance(config, dict) else {"?"}
        if extra or config.get("method") != "ngram" or not isinstance(config.get("num_speculative_tokens"), int):
            return ""
        return template.format(k=config["num_speculative_tokens"])
    return translate


# engine -> vLLM flag -> that engine's flags for it
TRANSLATIONS: dict[str, dict[str, Translate]] = {
    SGLANG: {
        "--max-num-seqs": _to("--max-running-requests"), "--max-model-len": _to("--context-length"),
        "--max-num-batched-tokens": _to("--chunked-prefill-size"),
        "--enable-prefix-caching": _text("(drop --disable-radix-cache: the radix cache is on unless it is given)"),
        "--no-enable-prefix-caching": _text("--disable-radix-cache"),
        "--kv-cache-dtype": _text("--kv-cache-dtype fp8_e5m2"), "--tensor-parallel-size": _to("--tp-size"),
        "--data-parallel-size": _to("--dp-size"), "--quantization": _to("--quantization"),
        "--gpu-memory-utilization": _to("--mem-fraction-static"),
        "--speculative-config": _speculation("--speculative-algorithm NGRAM --speculative-num-draft-tokens {k}"),
    },
    LLAMACPP: {
        "--max-num-seqs": _llamacpp_slots, "--max-model-len": _llamacpp_context,
        "--max-num-batched-tokens": _to("--batch-size"), "--enable-prefix-caching": _text("--cache-prompt"),
        "--kv-cache-dtype": _text("--cache-type-k q8_0 --cache-type-v q8_0"),
        "--quantization": _text("(load a quantized GGUF, e.g. Q4_K_M)"),
        "--speculative-config": _speculation("--spec-type ngram-simple --draft-max {k}"),
    },
    TGI: {
        "--max-num-seqs": _to("--max-batch-size"), "--max-model-len": _to("--max-total-tokens"),
        "--max-num-batched-tokens": _to("--max-batch-prefill-tokens"), "--tensor-parallel-size": _to("--num-shard"),
        "--quantization": _to("--quantize"),
        "--speculative-config": _speculation("--speculate {k}"),
    },
}


def translate(fix: Fix, engine: str, cfg: ServerConfig | None) -> str:
    """The fix's vLLM flags as ``engine``'s; "" when it has none, or a flag has no counterpart there."""
    table = TRANSLATIONS.get(engine)
    flags = plain_flags(fix.vllm, placeholders=True) if table is not None else None
    if not table or not flags or any(name not in table for name, _ in flags):
        return ""
    parts = [table[name](value, cfg) for name, value in flags]
    return " ".join(parts) if all(parts) else ""


def localize_fixes(findings: list[Finding], engine: str | None, cfg: ServerConfig | None) -> list[Finding]:
    """Every fix with its flags for ``engine`` (``Fix.engine_flags``) when that is an engine other than kvpilot
    and vLLM, whose flags the fixes already name; unchanged otherwise. A fix a rule wrote for that engine itself
    (its ``engine`` and ``engine_flags`` set: a flag only that engine has) keeps its flags."""
    if engine not in TRANSLATIONS:
        return findings
    return [replace(f, fixes=tuple(x if x.engine == engine and x.engine_flags else
                                   replace(x, engine=engine, engine_flags=translate(x, engine, cfg)) for x in f.fixes))
            for f in findings]
