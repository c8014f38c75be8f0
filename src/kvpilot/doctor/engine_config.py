"""The serving limits of engines other than kvpilot and vLLM, from the endpoint each one has for them.

* llama-server: ``GET /props`` (``total_slots``: requests it runs at once; ``default_generation_settings.n_ctx``:
  the context one slot holds, its whole ``--ctx-size`` split over ``--parallel`` slots). Each slot owns its
  context, so a request never waits for KV memory, only for a slot: the KV pool is left unknown, and the
  KV-pool rules (built for a shared paged pool) stay quiet.
* SGLang: ``GET /server_info`` (``/get_server_info`` before it was renamed): its server arguments and scheduler
  facts (``max_running_requests``, ``context_length``, ``chunked_prefill_size``, ``disable_radix_cache``,
  ``max_total_num_tokens``: the KV pool in tokens, kept as blocks of one token).
* TGI: ``GET /info`` (``max_total_tokens`` per request, ``max_batch_total_tokens``: the tokens a batch holds,
  ``max_batch_size`` when set).

Each parser is pure (a JSON document -> :class:`ServerConfig`); :func:`fetch_engine_config` asks the
endpoint of the engine detected and returns None when it does not answer.
"""

from __future__ import annotations

from typing import Any

import httpx

from kvpilot.doctor.engines import LLAMACPP, SGLANG, TGI
from kvpilot.doctor.server_config import ServerConfig


def _int(value: Any) -> int | None:
    try:
        out = int(float(value))
    except (TypeError, ValueError):
        return None
    return out if out > 0 else None


def from_llamacpp_props(doc: dict[str, Any]) -> ServerConfig:
    settings = doc.get("default_generation_settings") or {}
    return ServerConfig(source="llama-server GET /props", engine=LLAMACPP, max_num_seqs=_int(doc.get("total_slots")),
                        max_model_len=_int(settings.get("n_ctx")))


def from_sglang_info(doc: dict[str, Any]) -> ServerConfig:
    tokens = _int(doc.get("max_total_num_tokens"))
    radix_off = doc.get("disable_radix_cache")
    return ServerConfig(
        source="SGLang GET /server_info", engine=SGLANG, num_blocks=tokens, block_size=1 if tokens else None,
        max_model_len=_int(doc.get("context_length")), max_num_seqs=_int(doc.get("max_running_requests")),
        max_num_batched_tokens=_int(doc.get("chunked_prefill_size")),
        enable_prefix_caching=None if not isinstance(radix_off, bool) else not radix_off)


def from_tgi_info(doc: dict[str, Any]) -> ServerConfig:
    tokens = _int(doc.get("max_batch_total_tokens"))
    return ServerConfig(source="TGI GET /info", engine=TGI, num_blocks=tokens, block_size=1 if tokens else None,
                        max_model_len=_int(doc.get("max_total_tokens")), max_num_seqs=_int(doc.get("max_batch_size")))


# engine -> (paths to try in order, parser)
ENDPOINTS = {
    LLAMACPP: (("/props",), from_llamacpp_props),
    SGLANG: (("/server_info", "/get_server_info"), from_sglang_info),
    TGI: (("/info",), from_tgi_info),
}


def fetch_engine_config(engine: str | None, base_url: str, headers: dict[str, str],
                        timeout_s: float = 10.0) -> ServerConfig | None:
    """The detected engine's configuration endpoint, parsed; None for kvpilot and vLLM (their facts come from the
    capacity endpoint and /metrics), an unknown engine, or an endpoint that does not answer with JSON."""
    if engine not in ENDPOINTS:
        return None
    paths, parse = ENDPOINTS[engine]
    for path in paths:
        try:
            resp = httpx.get(base_url + path, headers=headers, timeout=timeout_s)
            doc = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            doc = None
        if isinstance(doc, dict):
            return parse(doc)
    return None
