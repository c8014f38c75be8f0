"""The live dashboard of `kvpilot serve`: `GET /dashboard` (one self-contained HTML page, dashboard.html) and the
JSON it polls, `GET /v1/kvpilot/dashboard`.

The JSON is read from the same metrics registry as `GET /metrics`, in one collection, so every number on the
page is one /metrics would have shown at that moment: gauges as they are, counters and the per-stage
histograms' sum and count as totals since start. The page computes rates and per-interval means from the
difference between two polls. Nothing here needs the engine: before it is ready the scheduler's gauges are
null and the counters 0.
"""

from __future__ import annotations

import time
from functools import lru_cache
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from kvpilot.server.observe.metrics import ServerMetrics


# Stage -> the histogram that times it: the four stages of a request's life, plus the latencies users watch.
STAGE_HISTOGRAMS: dict[str, str] = {
    "queue": "vllm:request_queue_time_seconds",
    "tokenize": "kvpilot:tokenization_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "serialize": "kvpilot:serialization_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}
GAUGES: dict[str, str] = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
                          "kv_cache_usage": "vllm:kv_cache_usage_perc"}
COUNTERS: dict[str, str] = {"prompt_tokens": "vllm:prompt_tokens_total",
                            "generation_tokens": "vllm:generation_tokens_total",
                            "requests_finished": "vllm:request_success_total",
                            "requests_rejected": "kvpilot:requests_rejected_total",
                            "preemptions": "vllm:num_preemptions_total"}


def _samples(metrics: ServerMetrics) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> {sorted labels: value}, from one collection of the registry (a consistent view)."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def dashboard_snapshot(metrics: ServerMetrics) -> dict[str, Any]:
    """The current values (module docstring). `time` is the Unix time of the reading, in seconds; `gauges`
    are null until the engine has run a step; counters sum over their labels (finish reasons, reject
    reasons); `stages` hold each histogram's `sum_s` and `count` since start."""
    samples = _samples(metrics)

    def total(name: str) -> float:
        return float(sum(samples.get(name, {}).values()))

    def gauge(name: str) -> float | None:
        values = samples.get(name)
        return float(sum(values.values())) if values else None

    blocks = {dict(labels).get("state"): value for labels, value in samples.get("kvpilot:kv_cache_blocks", {}).items()}
    return {
        "time": time.time(),
        "model": metrics.model_name,
        "gauges": {key: gauge(name) for key, name in GAUGES.items()},
        "kv_cache_blocks": {"used": blocks.get("used"), "total": blocks.get("total")},
        "counters": {key: total(name) for key, name in COUNTERS.items()},
        "stages": {stage: {"sum_s": total(name + "_sum"), "count": total(name + "_count")}
                   for stage, name in STAGE_HISTOGRAMS.items()},
        "resident_bytes": gauge("kvpilot:process_resident_bytes"),
    }


@lru_cache(maxsize=1)
def dashboard_html() -> str:
    """The page (package data next to this module): inline CSS and JS, no external resource, so it works
    on a machine without internet access."""
    return resources.files("kvpilot.server.observe").joinpath("dashboard.html").read_text(encoding="utf-8")


def add_dashboard_routes(app: FastAPI, metrics: ServerMetrics) -> None:
    """Registers GET /dashboard (the page) and GET /v1/kvpilot/dashboard (its data); both always 200."""

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        """The live dashboard: queue, KV cache, stage latencies and throughput, polled from GET /v1/kvpilot/dashboard."""
        return HTMLResponse(dashboard_html(), headers={"Cache-Control": "no-cache"})

    @app.get("/v1/kvpilot/dashboard")
    async def dashboard_data() -> dict[str, Any]:
        """The dashboard's current values, read from the /metrics registry (dashboard_snapshot)."""
        return dashboard_snapshot(metrics)
