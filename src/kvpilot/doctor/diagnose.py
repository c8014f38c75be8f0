"""Run the rules, rank the findings, and say how much headroom a healthy deployment has left."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvpilot.doctor.attribution import attribute
from kvpilot.doctor.current_settings import drop_noop_fixes
from kvpilot.doctor.engine_flags import localize_fixes
from kvpilot.doctor.findings import Finding, Severity
from kvpilot.doctor.inputs import DoctorInputs, RunData
from kvpilot.doctor.probe_plan import RampPoint, knee_reason, ramp_level
from kvpilot.doctor.ranking import rank
from kvpilot.doctor.roofline_ref import RooflineRef, limit_words
from kvpilot.doctor.rules import RULES, Rule, RuleContext
from kvpilot.doctor.rules.prefill import mixing_note, stall_note
from kvpilot.doctor.rules.routing import replica_lines
from kvpilot.doctor.signals import median
from kvpilot.doctor.slo import slo_lines
from kvpilot.doctor.split import LatencySplit
from kvpilot.doctor.thresholds import Thresholds

EXIT_HEALTHY, EXIT_FINDINGS, EXIT_UNUSABLE = 0, 1, 2


@dataclass(frozen=True)
class DoctorReport:
    """The diagnosis. Invariants: ``findings`` are ranked (:func:`kvpilot.doctor.ranking.rank`);
    ``healthy`` is True exactly when no finding is above low severity."""

    findings: tuple[Finding, ...]
    splits: tuple[LatencySplit, ...]
    headroom: tuple[str, ...]
    sources: tuple[str, ...]
    metrics_source: str
    roofline: dict[str, Any] | None
    created_unix: float
    roofline_share: float | None = None
    """Measured batch-1 decode speed as a share of the roofline's (TPOT floor / measured TPOT)."""
    server_config: dict[str, Any] | None = None
    resources: dict[str, Any] | None = None
    slos_ms: dict[str, float] | None = None
    """The latency targets the findings were judged against (--slo, --workload, or bench's)."""
    workload: str | None = None
    engine: str | None = None
    """The engine that served (kvpilot.doctor.engines): fixes are printed as its flags first."""

    @property
    def healthy(self) -> bool:
        return all(f.severity is Severity.LOW for f in self.findings)

    @property
    def exit_code(self) -> int:
        return EXIT_HEALTHY if self.healthy else EXIT_FINDINGS

    @property
    def verdict(self) -> str:
        roof = ""
        if self.roofline_share is not None and self.roofline is not None:
            words = limit_words(self.roofline.get("dtype"), self.roofline.get("calibrated"))
            roof = (f"; decode at {self.roofline_share:.0%} of {words} "
                    f"({self.roofline['model']} on {self.roofline['gpu']})")
        if self.healthy:
            return "healthy: no bottleneck found" + (f" ({len(self.findings)} low-severity notes)"
                                                     if self.findings else "") + roof
        top = self.findings[0]
        return (f"bottleneck: {top.title} ({top.rule_id}, {top.severity.value}, confidence {top.confidence:.0%})"
                + roof)

    def to_json(self) -> dict[str, Any]:
        return {"tool": "kvpilot doctor", "schema_version": 1, "created_unix": self.created_unix,
                "healthy": self.healthy, "verdict": self.verdict, "exit_code": self.exit_code,
                "findings": [f.to_json() for f in self.findings],
                "latency_split_ms": [s.to_json() for s in self.splits],
                "headroom": list(self.headroom), "sources": list(self.sources),
                "metrics_source": self.metrics_source, "roofline": self.roofline,
                "roofline_share": self.roofline_share, "server_config": self.server_config,
                "resources": self.resources, "slos_ms": self.slos_ms, "workload": self.workload,
                "engine": self.engine}


def _decode_share_line(roof: RooflineRef, tpot: float, in_flight: float) -> str:
    """Batch-1 decode against the TPOT floor, saying whether the floor is this machine's measured limit."""
    measured = f"{roof.decode_step_ms:.1f} ms vs {tpot:.1f} ms measured at {in_flight:.1f} in flight"
    share = f"decode at {roof.decode_step_ms / tpot:.0%} of {limit_words(roof.dtype, roof.calibrated)}"
    if roof.calibrated:
        return f"{share} (TPOT floor {measured}; rates from `kvpilot fit --calibrate`)"
    return f"{share} TPOT floor ({measured}; nominal rates: `kvpilot fit --calibrate` measures this machine's)"


def _roofline_share(ctx: RuleContext) -> float | None:
    """Roofline TPOT floor / measured median TPOT of the lowest-load run."""
    roof, runs = ctx.inputs.verdict_roofline, ctx.inputs.runs
    tpot = median(r.tpot_ms for r in runs[0].ok) if runs else None
    return roof.decode_step_ms / tpot if roof is not None and tpot else None


def _headroom(ctx: RuleContext) -> list[str]:
    """What is left before the first limit, from what was measured, then effects inherent to the
    hardware (with their size) and how much of the machine the server got."""
    lines = []
    view, roof, peak = ctx.view, ctx.inputs.verdict_roofline, ctx.inputs.peak_run
    cfg = ctx.inputs.server_config
    if cfg is not None and cfg.max_len_requests is not None:
        lines.append(f"KV pool {cfg.num_kv_tokens:,} tokens: {cfg.max_len_requests:.1f} requests of max_model_len "
                     f"{cfg.max_model_len:,} ({cfg.source})")
    if view.kv_usage_max is not None:
        lines.append(f"KV cache peaked at {view.kv_usage_max:.0%}: {1 - view.kv_usage_max:.0%} free")
    split = ctx.server_split
    if split is not None and split.queue_ms is not None:
        where = f" at {split.in_flight:.1f} requests in flight" if split.in_flight is not None else f" ({split.source})"
        lines.append(f"queue time {split.queue_ms:.1f} ms{where}")
    if view.num_preemptions is not None:
        lines.append(f"{view.num_preemptions:.0f} preemptions")
    low = ctx.inputs.runs[0] if ctx.inputs.runs else None
    tpot = median(r.tpot_ms for r in low.ok) if low is not None else None
    if roof is not None and low is not None and tpot:
        lines.append(_decode_share_line(roof, tpot, low.in_flight))
    if roof is not None and roof.calibration_note:
        lines.append(f"note: {roof.calibration_note}")
    if peak is not None:
        lines.append(f"peak output throughput {peak.output_throughput:,.1f} tok/s at "
                     f"{peak.in_flight:.1f} requests in flight")
        knee = _knee_line(ctx)
        if knee is not None:
            lines.append(knee)
        if roof is not None and roof.aggregate_tokens_per_s > 0:
            lines.append(f"that is {peak.output_throughput / roof.aggregate_tokens_per_s:.0%} of the roofline "
                         f"({roof.aggregate_tokens_per_s:,.0f} tok/s at batch {roof.batch_size} on {roof.gpu})")
    lines.extend(slo_lines(ctx.inputs.runs, ctx.slos))
    lines.extend(note for note in (mixing_note(ctx), stall_note(ctx)) if note is not None)
    lines.extend(replica_lines(ctx))
    lines.extend(_resource_lines(ctx))
    return lines


def _load_level(run: RunData) -> int:
    """The concurrency a run was sent at: a probe's ramp phase names it; other runs, their measured in-flight."""
    level = ramp_level(run.source)
    return level if level is not None else max(1, round(run.in_flight))


def _knee_line(ctx: RuleContext) -> str | None:
    """Where throughput stopped rising with load (the saturation knee), or that it was still rising at the
    highest load measured. From the probe's ramp (same prompts at each point), else from saved runs such as
    a bench sweep; None with fewer than three loads (two points make no curve)."""
    runs = [r for r in ctx.inputs.runs if r.ok and not r.burst]
    ramp = [r for r in runs if ramp_level(r.source) is not None]
    series = sorted(ramp if ramp else runs, key=_load_level)
    if len(series) < 3:
        return None
    points = [RampPoint(_load_level(r), r.output_throughput, 1.0 - len(r.ok) / len(r.records)) for r in series]
    for end in range(2, len(points) + 1):
        reason = knee_reason(points[:end])
        if reason is not None:
            knee = points[end - 2]
            return (f"saturation knee at {knee.concurrency} in flight ({knee.output_throughput:,.1f} tok/s): "
                    f"past it, {reason}")
    return (f"throughput still rising at the highest load measured ({points[-1].concurrency} in flight): "
            "the knee is further out (probe with a higher --max-concurrency)")


def _resource_lines(ctx: RuleContext) -> list[str]:
    r = ctx.inputs.resources
    if r is None:
        return []
    lines = []
    if r.server_cores is not None:
        wait = f", waiting for a CPU {r.run_queue_share:.0%} of its runnable time" if r.run_queue_share is not None \
            else ""
        lines.append(f"server used {r.server_cores:.2f} CPU cores over {r.wall_s:.0f} s{wait} ({r.source})")
    if r.host_busy_share is not None and r.num_cpus is not None:
        lines.append(f"host: {r.host_busy_share:.0%} of {r.num_cpus} CPUs busy, load average {r.load_avg_1m:.1f}"
                     + (f", steal {r.steal_share:.0%}" if r.steal_share else ""))
    for g in r.gpus:
        lines.append(f"GPU {g.index}: {g.utilization:.0%} utilised, {g.memory_used_bytes / 2**30:.1f} of "
                     f"{g.memory_total_bytes / 2**30:.1f} GiB used (NVML)")
    return lines


def diagnose(inputs: DoctorInputs, thresholds: Thresholds | None = None,
             rules: tuple[Rule, ...] = RULES) -> DoctorReport:
    """Apply every rule to the inputs; pure apart from the timestamp."""
    ctx = RuleContext.build(inputs, thresholds or Thresholds())
    # in the rules' order, which ranking keeps as the precedence between findings of one share band
    findings = attribute([f for rule in rules if (f := rule(ctx)) is not None], ctx)
    findings = localize_fixes(drop_noop_fixes(findings, inputs.server_config), inputs.engine, inputs.server_config)
    roof = inputs.verdict_roofline
    return DoctorReport(
        findings=rank(findings), splits=ctx.splits, headroom=tuple(_headroom(ctx)), sources=inputs.sources,
        metrics_source=ctx.view.source, roofline=roof.__dict__.copy() if roof is not None else None,
        created_unix=time.time(), roofline_share=_roofline_share(ctx),
        server_config=inputs.server_config.to_json() if inputs.server_config is not None else None,
        resources=inputs.resources.to_json() if inputs.resources is not None else None,
        slos_ms=ctx.slos or None, workload=inputs.workload, engine=inputs.engine)
