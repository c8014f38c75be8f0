"""Measurement math: percentiles, SLOs, goodput and run aggregates over request records."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any
from collections.abc import Iterable

import numpy as np

from kvpilot.bench.breakdown import stage_breakdown
from kvpilot.bench.records import RequestRecord

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)
SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e")
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


class SloError(ValueError):
    """A malformed ``--slo`` string."""


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric in ms (all None when there were no samples)."""

    num_samples: int
    mean: float | None
    std: float | None
    median: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    max: float | None

    @staticmethod
    def of(values: Iterable[float | None]) -> Distribution:
        arr = np.asarray([v for v in values if v is not None], dtype=float)
        if arr.size == 0:
            return Distribution(0, None, None, None, None, None, None, None)
        p50, p90, p95, p99 = (float(x) for x in np.percentile(arr, PERCENTILES))
        return Distribution(int(arr.size), float(arr.mean()), float(arr.std()), p50, p90, p95, p99,
                            float(arr.max()))


def parse_slo(text: str | None) -> dict[str, float]:
    """Parse ``ttft=200ms,tpot=50ms,e2e=5s`` into ms limits; bare numbers are ms."""
    if not text:
        return {}
    slos: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        match = _DURATION.match(value)
        if not sep or key not in SLO_METRICS or match is None:
            raise SloError(f"bad SLO '{part.strip()}': use e.g. ttft=200ms,tpot=50ms,itl=100ms,e2e=5s "
                           f"(metrics: {', '.join(SLO_METRICS)})")
        number = float(match.group(1))
        slos[key] = number * 1000.0 if match.group(2) == "s" else number
    return slos


def meets_slo(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A request is good when it succeeded and each SLO'd metric is within its limit.

    ITL's SLO applies to every gap (vLLM's goodput uses per-request values; a single long stall is
    what users notice, so the max gap is checked).
    """
    if not record.ok:
        return False
    values = {"ttft": record.ttft_ms, "tpot": record.tpot_ms, "e2e": record.e2e_ms,
              "itl": max(record.itl_ms) if record.itl_ms else None}
    return all((v := values[k]) is None or v <= limit for k, limit in slos.items())


@dataclass(frozen=True)
class Aggregates:
    """Run-level numbers; throughputs are per second over ``duration_s`` (first send to last byte)."""

    num_requests: int
    num_ok: int
    num_errors: int
    errors_by_kind: dict[str, int]
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    num_good: int
    goodput: float | None
    good_fraction: float | None
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    queue_wait_ms: Distribution
    sched_lag_ms: Distribution
    stages_ms: dict[str, Distribution] | None
    groups_ms: dict[str, dict[str, Distribution]] | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


MAX_GROUPS = 16


def by_group(ok: list[RequestRecord]) -> dict[str, dict[str, Distribution]] | None:
    """TTFT/TPOT/E2E per ``group_id`` (long vs short, prefix groups); None without groups or with
    more than :data:`MAX_GROUPS` (per-session groups would only bloat the summary)."""
    groups = sorted({r.group_id for r in ok if r.group_id is not None})
    if not groups or len(groups) > MAX_GROUPS:
        return None
    return {g: {"ttft": Distribution.of(r.ttft_ms for r in ok if r.group_id == g),
                "tpot": Distribution.of(r.tpot_ms for r in ok if r.group_id == g and r.tpot_ms is not None),
                "e2e": Distribution.of(r.e2e_ms for r in ok if r.group_id == g)} for g in groups}


def error_key(record: RequestRecord) -> str:
    """Errors grouped by HTTP status ("http_429") or by client-side kind ("connect_error")."""
    if record.error_kind == "http_status" and record.status is not None:
        return f"http_{record.status}"
    return record.error_kind or "unknown"


def run_duration_s(records: list[RequestRecord]) -> float:
    """From the first send to the last completion (failed requests count: they used the time)."""
    if not records:
        return 0.0
    start = min(r.sent_s for r in records)
    end = max(r.sent_s + (r.e2e_ms or 0.0) / 1000.0 for r in records)
    return max(end - start, 1e-9)


def aggregate(records: list[RequestRecord], slos: dict[str, float],
              duration_s: float | None = None) -> Aggregates:
    """Aggregate request records; ``duration_s`` defaults to :func:`run_duration_s`."""
    ok = [r for r in records if r.ok]
    duration = duration_s if duration_s is not None else run_duration_s(records)
    duration = max(duration, 1e-9)
    num_out = sum(r.num_output_tokens for r in ok)
    num_in = sum(r.num_prompt_tokens or 0 for r in ok)
    num_good = sum(1 for r in records if meets_slo(r, slos)) if slos else len(ok)
    stages = [stage_breakdown(r) for r in ok]
    stage_rows = [s for s in stages if s is not None]
    stage_dists = ({k: Distribution.of(s[k] for s in stage_rows) for k in stage_rows[0]}
                   if stage_rows else None)
    return Aggregates(
        num_requests=len(records), num_ok=len(ok), num_errors=len(records) - len(ok),
        errors_by_kind=dict(Counter(error_key(r) for r in records if not r.ok)),
        duration_s=duration,
        request_throughput=len(ok) / duration,
        output_token_throughput=num_out / duration,
        total_token_throughput=(num_out + num_in) / duration,
        num_good=num_good,
        goodput=num_good / duration if slos else None,
        good_fraction=num_good / len(records) if slos and records else None,
        ttft_ms=Distribution.of(r.ttft_ms for r in ok),
        tpot_ms=Distribution.of(r.tpot_ms for r in ok if r.tpot_ms is not None),
        itl_ms=Distribution.of(g for r in ok for g in r.itl_ms),
        e2e_ms=Distribution.of(r.e2e_ms for r in ok),
        queue_wait_ms=Distribution.of(r.queue_wait_ms for r in records),
        sched_lag_ms=Distribution.of(r.sched_lag_ms for r in records),
        stages_ms=stage_dists,
        groups_ms=by_group(ok),
    )
