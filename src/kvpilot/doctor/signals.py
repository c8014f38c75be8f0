"""Numbers the rules share: robust statistics, the merged server-metrics view, request timelines.

Everything here is a pure function of :class:`DoctorInputs`; rules decide what the numbers mean.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvpilot.bench.records import RequestRecord
from kvpilot.bench.scrape import max_present
from kvpilot.doctor.inputs import DoctorInputs


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(statistics.median(vals)) if vals else None


def quantile(values: Iterable[float | None], q: float) -> float | None:
    """Linear-interpolated quantile, q in [0, 1] (numpy's default method)."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return None
    pos = q * (len(vals) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Correlation; None with fewer than 3 points or no spread."""
    if len(xs) < 3 or len(xs) != len(ys):
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys over xs; None without spread in xs."""
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


@dataclass(frozen=True)
class MetricsView:
    """Server-side state merged from the bench's scrapes and ``--metrics-file`` (None: not exposed).
    ``source`` names where the values came from, for evidence lines."""

    kv_usage_max: float | None
    waiting_mean: float | None
    waiting_max: float | None
    running_max: float | None
    num_preemptions: float | None
    prefix_hit_rate: float | None
    prefix_caching_enabled: bool | None
    swapped: float | None
    cpu_kv_usage: float | None
    swap_used_bytes: float | None
    source: str
    process_swap_bytes: float | None = None
    process_swap_share: float | None = None
    major_faults_per_token: float | None = None
    """Server-process memory (kvpilot's /proc gauges): peak swapped-out bytes, their peak share of
    resident + swapped, and major page faults per generated token over the measured interval (None
    when no interval was measured: one scrape's lifetime totals include the model load)."""
    config_source: str = "vllm:cache_config_info"  # where prefix_caching_enabled came from


def _sum(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) if vals else None


def _records_hit_rate(records: list[RequestRecord]) -> float | None:
    with_server = [r for r in records if r.server is not None and r.server.num_prompt_tokens > 0]
    prompt = sum(r.server.num_prompt_tokens for r in with_server if r.server)
    return sum(r.server.num_cached_tokens for r in with_server if r.server) / prompt if prompt else None


def _faults_per_token(inputs: DoctorInputs) -> float | None:
    """Major page faults of the server per generated token: the bench's per-run counter deltas over
    the tokens of those runs, else the metrics snapshot's delta (two scrapes) over its token delta."""
    runs = [run for run in inputs.runs if run.server_metrics and run.server_metrics.get("major_faults") is not None]
    tokens = sum(r.num_output_tokens for run in runs for r in run.ok)
    if runs and tokens:
        return sum(float(run.server_metrics["major_faults"]) for run in runs if run.server_metrics) / tokens
    snap = inputs.metrics
    if snap is None or not snap.interval:
        return None
    return ratio(snap.get("major_faults"), snap.get("generation_tokens"))


def metrics_view(inputs: DoctorInputs) -> MetricsView:
    """Bench scrapes first (they cover exactly the measured runs), the metrics file fills gaps."""
    summaries = [run.server_metrics for run in inputs.runs if run.server_metrics]
    snap = inputs.metrics

    def from_runs(key: str, combine: Callable[[Iterable[float | None]], float | None] = max_present) -> float | None:
        return combine(s.get(key) for s in summaries)

    def snap_get(key: str) -> float | None:
        return snap.get(key) if snap is not None else None

    preempt_records = _sum(r.server.num_preemptions for r in inputs.ok_records if r.server)
    hit_rate = from_runs("prefix_cache_hit_rate")
    if hit_rate is None and snap is not None:
        queries, hits = snap.get("prefix_queries"), snap.get("prefix_hits")
        hit_rate = hits / queries if queries and hits is not None else snap.get("prefix_hit_rate")
    if hit_rate is not None and hit_rate < 0:  # vLLM V0 reports -1 when prefix caching is off
        hit_rate = None
    if hit_rate is None:
        hit_rate = _records_hit_rate(inputs.ok_records)
    cfg = inputs.server_config
    caching = snap.prefix_caching_enabled if snap is not None else None
    config_source = "vllm:cache_config_info"
    if caching is None and cfg is not None and cfg.enable_prefix_caching is not None:
        caching, config_source = cfg.enable_prefix_caching, cfg.source
    sources = (["bench scrapes of /metrics"] if summaries else []) + (
        [f"metrics file ({snap.flavor} names)"] if snap is not None else [])
    return MetricsView(
        kv_usage_max=max_present([from_runs("kv_usage_max"), snap_get("kv_usage")]),
        waiting_mean=from_runs("waiting_mean") if summaries else snap_get("waiting"),
        waiting_max=max_present([from_runs("waiting_max"), snap_get("waiting")]),
        running_max=max_present([from_runs("running_max"), snap_get("running")]),
        num_preemptions=max_present([from_runs("num_preemptions", _sum), snap_get("preemptions"), preempt_records]),
        prefix_hit_rate=hit_rate,
        prefix_caching_enabled=caching,
        config_source=config_source,
        swapped=snap_get("swapped"), cpu_kv_usage=snap_get("cpu_kv_usage"),
        swap_used_bytes=max_present([from_runs("host_swap_used_max"), snap.swap_used_bytes if snap is not None else None]),
        source=" + ".join(sources) or "none",
        process_swap_bytes=max_present([from_runs("process_swap_max"), snap_get("process_swap")]),
        process_swap_share=max_present([from_runs("process_swap_share_max"),
                                 snap.process_swap_share if snap is not None else None]),
        major_faults_per_token=_faults_per_token(inputs))


def first_token_s(r: RequestRecord) -> float | None:
    """When the request's first token arrived, on the run clock."""
    return r.sent_s + r.ttft_ms / 1000.0 if r.ttft_ms is not None else None


def gap_ends(r: RequestRecord) -> list[tuple[float, float]]:
    """(time the gap ended on the run clock, gap ms) for every inter-token gap of a request."""
    t = first_token_s(r)
    if t is None:
        return []
    out = []
    for gap in r.itl_ms:
        t += gap / 1000.0
        out.append((t, gap))
    return out


def is_long(r: RequestRecord, median_prompt: float, factor: float) -> bool:
    return r.group_id == "long" or (r.num_prompt_tokens or 0) >= factor * median_prompt > 0


def median_prompt_len(records: list[RequestRecord]) -> float:
    return median(float(r.num_prompt_tokens or 0) for r in records) or 0.0


def overlaps_prefill(t0: float, t1: float, longs: list[RequestRecord], exclude: RequestRecord) -> bool:
    """Whether [t0, t1] intersects another long request's prefill window [sent, first token]."""
    for other in longs:
        end = first_token_s(other)
        if other is not exclude and end is not None and other.sent_s <= t1 and end >= t0:
            return True
    return False
