"""Synthetic-but-realistic bench results for the doctor's tests, written through the bench's own code
(RunResult.analyse -> build_result -> write_json), so the files match what `kvpilot bench --output` writes."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape
from kvpilot.bench.records import RequestRecord, ServerTimings
from kvpilot.bench.replicas import ReplicaPlan, ReplicaSample
from kvpilot.bench.result import RunResult, build_result, write_json
from kvpilot.bench.runner import RunOutput
from kvpilot.bench.scrape import MetricsSample


def req(i: int, sent_s: float, *, queue: float = 0.5, tokenize: float = 1.0, prefill: float = 40.0,
        itl: float | list[float] = 12.0, num_out: int = 32, net: float = 2.0, prompt: int = 256,
        group: str | None = None, cached: int = 0, preempt: int = 0, server: bool = True,
        sched_lag: float = 0.0, replica: str | None = None) -> RequestRecord:
    """One successful streamed request whose client and server timings agree (client = server + net)."""
    gaps = tuple(itl) if isinstance(itl, list) else tuple([itl] * max(0, num_out - 1))
    server_ttft = queue + tokenize + prefill
    decode = sum(gaps)
    server_e2e = server_ttft + decode + 0.3
    timings = ServerTimings(f"r{i}", prompt, cached, preempt, queue, tokenize, prefill, server_ttft, decode,
                            0.3, server_e2e) if server else None
    return RequestRecord(
        request_index=i, item_id=i, turn_index=0, group_id=group, ok=True, status=200, error_kind=None,
        error=None, scheduled_s=sent_s, sent_s=sent_s, queue_wait_ms=0.0, sched_lag_ms=sched_lag,
        ttft_ms=server_ttft + net, e2e_ms=server_e2e + net, itl_ms=gaps, num_prompt_tokens=prompt,
        num_output_tokens=len(gaps) + 1, output_tokens_source="usage", num_chunks=len(gaps) + 1,
        server=timings, replica=replica)


def jitter(rng: random.Random, x: float, r: float = 0.1) -> float:
    return x * (1 + rng.uniform(-r, r))


def samples(duration_s: float, *, running: float, waiting: float, kv: float, preemptions: float = 0.0,
            prefix_queries: float = 0.0, prefix_hits: float = 0.0) -> list[MetricsSample]:
    """Scrapes before (counters 0), during (gauges), after (counters at their totals)."""
    during = {"running": running, "waiting": waiting, "kv_usage": kv}
    counters0 = {"preemptions": 0.0, "prefix_queries": 0.0, "prefix_hits": 0.0}
    counters1 = {"preemptions": preemptions, "prefix_queries": prefix_queries, "prefix_hits": prefix_hits}
    return [MetricsSample(0.0, "before", {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, **counters0}),
            *[MetricsSample(t, "during", {**during, **counters0}) for t in (duration_s / 3, 2 * duration_s / 3)],
            MetricsSample(duration_s, "after", {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, **counters1})]


def run(label: str, records: list[RequestRecord], *, concurrency: int | None = 4,
        metrics: list[MetricsSample] | None = None, loop_lag: list[tuple[float, float]] | None = None,
        request_rate: float = float("inf"), replica_plan: ReplicaPlan | None = None,
        replica_samples: list[ReplicaSample] | None = None, prefix_share: float | None = None,
        run_delay_share: float | None = None) -> RunResult:
    """``run_delay_share``: the loop's time waiting for a CPU as a share of its lateness (None: not measured)."""
    shape = LoadShape(concurrency=concurrency, request_rate=request_rate, num_requests=len(records))
    end = max(r.sent_s + (r.e2e_ms or 0) / 1000 for r in records)
    lag = loop_lag if loop_lag is not None else [(t / 10, 0.3) for t in range(int(end * 10) + 1)]
    waited = None if run_delay_share is None else run_delay_share * sum(s[1] for s in lag)
    out = RunOutput(shape, records, end, 1.7e9, lag, metrics or [], None, replica_plan, replica_samples or [],
                    loop_run_delay_ms=waited)
    return RunResult.analyse(label, out, {}, 10.0, prefix_share)


def write(path: Path, runs: list[RunResult], dataset: DatasetConfig | None = None,
          slos: dict[str, float] | None = None, capacity: dict[str, Any] | None = None,
          base_url: str = "http://127.0.0.1:8000") -> str:
    """``capacity``: the server's GET /v1/kvpilot/capacity as bench stores it (None: a server without one)."""
    config: dict[str, Any] = {
        "target": {"base_url": base_url, "model": "m", "endpoint": "completions",
                   "api_key": None, "stream": True, "ignore_eos": True, "timeout_s": 300.0},
        "dataset": dataclasses.asdict(dataset or DatasetConfig()),
        "load": dataclasses.asdict(runs[0].output.shape), "slos_ms": slos or {}, "tokenizer": "words",
        "sweep": False, "sweep_num_points": 5, "goodput_target": 0.9, "max_lag_ms": 10.0,
        "server_capacity": capacity}
    write_json(path, build_result(config, runs, None))
    return str(path)


def closed_loop(n: int, concurrency: int, make: Callable[[int, float], RequestRecord]) -> list[RequestRecord]:
    """Requests of a closed loop: each worker sends its next request when the previous ended.
    ``make(i, sent_s)`` builds request i."""
    free = [0.0] * concurrency
    out = []
    for i in range(n):
        w = min(range(concurrency), key=lambda k: free[k])
        r = make(i, free[w])
        out.append(r)
        free[w] = r.sent_s + (r.e2e_ms or 0) / 1000 + 0.001
    return out


LLAMA_METRICS = """# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {prompt_tokens}
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total {prompt_seconds}
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total {predicted}
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total {predicted_seconds}
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max {longest}
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 8
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""
"""llama-server's /metrics (the series the doctor reads), as its build in ~/.cache/kvpilot-peers writes them."""


def llama_metrics(path: Path, *, prompt_tokens: float, prompt_seconds: float, predicted: float = 0.0,
                  predicted_seconds: float = 0.0, longest: float = 0.0) -> str:
    """One scrape of :data:`LLAMA_METRICS` written to ``path``; returns the path (for --metrics-file)."""
    path.write_text(LLAMA_METRICS.format(prompt_tokens=prompt_tokens, prompt_seconds=prompt_seconds,
                                         predicted=predicted, predicted_seconds=predicted_seconds, longest=longest))
    return str(path)
