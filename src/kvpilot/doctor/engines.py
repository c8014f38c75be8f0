"""Which engine is serving: kvpilot, vLLM, SGLang, llama.cpp's llama-server or Hugging Face TGI.

The doctor reads every engine through one engine-neutral snapshot (kvpilot.doctor.prometheus maps each
engine's metric names to the same keys), so the rules never ask which engine it is. Two things do: the
server's configuration (each engine reports it at its own endpoint: kvpilot.doctor.engine_config) and the
fixes, which are printed as flags of the engine that runs (kvpilot.doctor.engine_flags).

The engine is told by, strongest first: what ``/v1/models`` says owns the model (``owned_by``: vLLM
"vllm", SGLang "sglang", llama-server "llamacpp", kvpilot "kvpilot"), the ``Server`` response header
(llama-server answers "llama.cpp"), then the metric names it exports (``kvpilot:``, ``sglang:``,
``llamacpp:``, ``tgi_``, ``vllm:``; kvpilot also exports vLLM's names, so ``kvpilot:`` wins over ``vllm:``).
"""

from __future__ import annotations

from collections.abc import Iterable

KVPILOT, VLLM, SGLANG, LLAMACPP, TGI = "kvpilot", "vllm", "sglang", "llama.cpp", "tgi"
ENGINES: tuple[str, ...] = (KVPILOT, VLLM, SGLANG, LLAMACPP, TGI)

DISPLAY = {KVPILOT: "kvpilot", VLLM: "vLLM", SGLANG: "SGLang", LLAMACPP: "llama.cpp", TGI: "TGI"}
"""How each engine is named in reports."""

OWNED_BY = {"kvpilot": KVPILOT, "vllm": VLLM, "sglang": SGLANG, "llamacpp": LLAMACPP, "tgi": TGI}
"""``/v1/models`` ``owned_by`` values -> engine."""

METRIC_PREFIXES: tuple[tuple[str, str], ...] = (
    ("kvpilot:", KVPILOT), ("sglang:", SGLANG), ("llamacpp:", LLAMACPP), ("tgi_", TGI), ("vllm:", VLLM))
"""Metric-name prefixes -> engine, in the order they are checked (kvpilot before vLLM: it exports both)."""


def engine_from_metrics(names: Iterable[str]) -> str | None:
    """The engine whose metric names appear among ``names`` (None: none of them)."""
    present = list(names)
    for prefix, engine in METRIC_PREFIXES:
        if any(name.startswith(prefix) for name in present):
            return engine
    return None


def engine_from_server_header(value: str | None) -> str | None:
    """llama-server's ``Server: llama.cpp``; other engines send a generic web server's name (uvicorn) or none."""
    return LLAMACPP if value and "llama.cpp" in value.lower() else None


def detect_engine(owned_by: str | None = None, server_header: str | None = None,
                  metric_names: Iterable[str] = ()) -> str | None:
    """The engine by the strongest signal present (see the module docstring); None when nothing tells."""
    by_owner = OWNED_BY.get((owned_by or "").strip().lower())
    return by_owner or engine_from_server_header(server_header) or engine_from_metrics(metric_names)


def display(engine: str | None) -> str:
    return DISPLAY.get(engine or "", engine or "unknown engine")
