"""What every rule receives: the inputs, the merged metrics view, the latency splits, the thresholds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.doctor.findings import Finding
from kvpilot.doctor.inputs import DoctorInputs, RunData
from kvpilot.doctor.signals import MetricsView, metrics_view
from kvpilot.doctor.slo import run_slos
from kvpilot.doctor.split import LatencySplit, latency_splits
from kvpilot.doctor.thresholds import Thresholds


@dataclass(frozen=True)
class RuleContext:
    """Read-only view for rules. ``splits`` follow ``inputs.runs`` (lowest load first), plus the
    metrics file's split last when it has histograms."""

    inputs: DoctorInputs
    view: MetricsView
    splits: tuple[LatencySplit, ...]
    th: Thresholds

    @staticmethod
    def build(inputs: DoctorInputs, th: Thresholds) -> RuleContext:
        return RuleContext(inputs, metrics_view(inputs), tuple(latency_splits(inputs)), th)

    @property
    def peak_split(self) -> LatencySplit | None:
        """The split at the highest realistic load: all-at-once bursts (a sweep's max-throughput
        probe queues by construction) only when nothing else was measured; the metrics file's split
        when there are no runs."""
        pairs = list(zip(self.inputs.runs, self.splits, strict=False))  # splits may end with the metrics split
        steady = [s for run, s in pairs if not run.burst] or [s for _, s in pairs]
        return steady[-1] if steady else (self.splits[-1] if self.splits else None)

    @property
    def server_split(self) -> LatencySplit | None:
        """Where server-side stages (queue, tokenize, server TTFT) were measured: kvpilot's
        per-request timings at the peak load, else the metrics file's histogram means (vLLM)."""
        peak = self.peak_split
        if peak is not None and peak.server_ttft_ms is not None:
            return peak
        from_metrics = [s for s in self.splits if s.source == "metrics means" and s.server_ttft_ms is not None]
        return from_metrics[-1] if from_metrics else peak

    @property
    def slos(self) -> dict[str, float]:
        """Latency targets in force (ms by metric): the doctor's --slo/--workload, else bench's; may be empty."""
        return run_slos(self.inputs.runs, self.inputs.slos_ms)

    @property
    def throughput_only(self) -> bool:
        """`--workload batch`: tokens per second are the goal, latency trade-offs are not problems."""
        return self.inputs.workload == "batch"

    def low_and_high(self) -> tuple[RunData, RunData] | None:
        """Lowest- and highest-load runs when their in-flight ratio allows comparing them."""
        runs = [r for r in self.inputs.runs if len(r.ok) >= self.th.min_requests and r.in_flight > 0]
        if len(runs) < 2 or runs[-1].in_flight < self.th.min_concurrency_ratio * runs[0].in_flight:
            return None
        return runs[0], runs[-1]


Rule = Callable[[RuleContext], Finding | None]
