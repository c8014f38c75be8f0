"""The bench result: per-run analysis and the versioned JSON / CSV files (schema in docs/bench.md)."""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpilot.bench.cache_hits import cache_hits
from kvpilot.bench.breakdown import STAGES, stage_breakdown
from kvpilot.bench.clientlag import ClientLag, judge_client_lag
from kvpilot.bench.replica_report import ReplicaReport, build_report
from kvpilot.bench.runner import RunOutput
from kvpilot.bench.scrape import MetricsSummary, summarize
from kvpilot.bench.stats import Aggregates, aggregate

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class RunResult:
    """One analysed run (a single bench, or one point of a sweep). ``replicas``: the run across replicas
    (None for a single server: no replica plan, and no response named its replica)."""

    label: str
    output: RunOutput
    aggregates: Aggregates
    client_lag: ClientLag
    metrics_summary: MetricsSummary | None
    replicas: ReplicaReport | None = None

    @staticmethod
    def analyse(label: str, output: RunOutput, slos: dict[str, float],
                max_lag_ms: float, prefix_share: float | None = None) -> RunResult:
        """``prefix_share``: the share of each prompt that is its group's shared prefix (the shared-prefix
        dataset's prefix_len / input_len), for the reuse the traffic offers a prefix cache."""
        summary = summarize(output.metrics) if output.metrics else None
        shape = output.shape
        scheduled = not shape.closed_loop and not math.isinf(shape.request_rate)
        lag = judge_client_lag(output.records, output.loop_lag_ms, max_lag_ms, has_schedule=scheduled,
                               loop_run_delay_ms=output.loop_run_delay_ms)
        replicas = build_report(output.records, output.replica_samples, output.replica_plan, prefix_share,
                                output.replica_error)
        return RunResult(label, output, aggregate(output.records, slos), lag, summary, replicas)

    def to_json(self) -> dict[str, Any]:
        shape = asdict(self.output.shape)
        return {
            "label": self.label,
            "load": {k: _finite(v) for k, v in shape.items()},
            "start_unix": self.output.start_unix,
            "wall_s": self.output.wall_s,
            "client_processes": self.output.num_client_processes,
            "aggregates": self.aggregates.to_json(),
            "client_lag": self.client_lag.to_json(),
            "server_metrics": {
                "samples": [asdict(s) for s in self.output.metrics],
                "summary": self.metrics_summary.to_json() if self.metrics_summary else None,
                "error": self.output.metrics_error,
            },
            "replicas": self.replicas.to_json() if self.replicas is not None else None,
            "cache": hits.to_json() if (hits := cache_hits(self.output.records, self.metrics_summary)) else None,
            "requests": [r.to_json() for r in self.output.records],
        }


@dataclass(frozen=True)
class Knee:
    """The saturation knee of a sweep: index into the runs, and why it was chosen."""

    index: int | None
    reason: str
    goodput_target: float


def _finite(v: Any) -> Any:
    """JSON has no infinity: inf rates are written as the string "inf"."""
    return "inf" if isinstance(v, float) and math.isinf(v) else v


def build_result(config: dict[str, Any], runs: list[RunResult], knee: Knee | None) -> dict[str, Any]:
    """The whole result document; ``config`` holds target (no API key), dataset, load, slos."""
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "kvpilot bench",
        "created_unix": time.time(),
        "config": {k: _finite(v) for k, v in config.items()},
        "runs": [r.to_json() for r in runs],
        "sweep": asdict(knee) if knee is not None else None,
    }


def _clean(obj: Any) -> Any:
    """Make a document strict JSON: inf -> "inf", nan -> None, tuples -> lists."""
    if isinstance(obj, float):
        return None if math.isnan(obj) else _finite(obj)
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


class ResultFileError(ValueError):
    """A result file that cannot be read as this schema."""


def read_result(path: str | Path) -> dict[str, Any]:
    """Load a result JSON written by ``--output``, checking its schema version."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultFileError(f"cannot read bench result '{path}': {exc}") from exc
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if version != SCHEMA_VERSION:
        raise ResultFileError(f"'{path}' has schema_version {version!r}; this kvpilot reads "
                              f"{SCHEMA_VERSION}: re-run `kvpilot bench --output` with this version")
    return doc


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(_clean(result), indent=1, allow_nan=False))


CSV_FIELDS: tuple[str, ...] = (
    "run", "request_index", "item_id", "turn_index", "group_id", "ok", "status", "error_kind",
    "scheduled_s", "sent_s", "queue_wait_ms", "sched_lag_ms", "ttft_ms", "tpot_ms", "e2e_ms",
    "itl_mean_ms", "itl_max_ms", "num_prompt_tokens", "num_output_tokens", "output_tokens_source",
    "num_cached_tokens", "num_preemptions", *(f"{s}_ms" for s in STAGES), "error", "replica")


def write_csv(path: str | Path, runs: list[RunResult]) -> None:
    """One row per request over all runs; stage columns are empty without server timings."""
    with Path(path).open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for run in runs:
            for r in run.output.records:
                stages = stage_breakdown(r) or {}
                row: dict[str, Any] = {k: getattr(r, k, None) for k in CSV_FIELDS if hasattr(r, k)}
                row.update(run=run.label, tpot_ms=r.tpot_ms,
                           itl_mean_ms=sum(r.itl_ms) / len(r.itl_ms) if r.itl_ms else None,
                           itl_max_ms=max(r.itl_ms) if r.itl_ms else None,
                           num_cached_tokens=r.server.num_cached_tokens if r.server else None,
                           num_preemptions=r.server.num_preemptions if r.server else None,
                           **{f"{s}_ms": stages.get(s) for s in STAGES})
                writer.writerow(row)
