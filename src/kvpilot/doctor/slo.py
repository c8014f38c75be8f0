"""What "fast enough" means for this deployment: `--slo` targets and `--workload` presets, and how each
measured load meets them (bench's goodput rule: a load meets the SLOs when 90% of its requests do).

The same GPU is tuned differently for a chatbot, a coding agent and a document queue: a chat user reads
along and waits for the first token; an agent waits for whole answers built on long contexts; a batch job
only counts tokens per second. Without any SLO the doctor judges latency trade-offs (TPOT rising with
batch size) as notes: only a target says whether the extra throughput was worth it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvpilot.bench.stats import SloError, meets_slo, parse_slo
from kvpilot.doctor.errors import DoctorInputError
from kvpilot.doctor.inputs import DoctorInputs, RunData

GOOD_FRACTION = 0.9
"""A load meets the SLOs when at least this share of its requests does (bench's --goodput-target)."""


@dataclass(frozen=True)
class Workload:
    """A preset goal: its name and latency targets (ms by metric; empty: throughput only)."""

    name: str
    slos_ms: dict[str, float]


WORKLOADS: dict[str, Workload] = {
    # people read along: the first token within 1 s, then faster than reading
    "chat": Workload("chat", {"ttft": 1000.0, "tpot": 100.0}),
    # a program waits for whole answers built on long contexts
    "agent": Workload("agent", {"ttft": 2000.0, "tpot": 50.0}),
    # a document queue: output tokens per second; latency only as a bound
    "batch": Workload("batch", {}),
}


@dataclass(frozen=True)
class Goal:
    """What the deployment is for: a `--workload` preset name and the SLOs in force (ms by metric)."""

    workload: str | None = None
    slos_ms: dict[str, float] = field(default_factory=dict)

    def apply(self, inputs: DoctorInputs) -> DoctorInputs:
        return replace(inputs, slos_ms=dict(self.slos_ms), workload=self.workload)


def resolve_goal(workload: str | None, slo: str | None) -> Goal:
    """The workload preset's SLOs with `--slo` targets overriding them. Raises DoctorInputError with
    the accepted forms for an unknown workload or a malformed SLO."""
    preset = None
    if workload is not None:
        preset = WORKLOADS.get(workload.strip().lower())
        if preset is None:
            raise DoctorInputError(f"--workload {workload!r}: use one of {', '.join(WORKLOADS)}")
    try:
        explicit = parse_slo(slo)
    except SloError as exc:
        raise DoctorInputError(f"--slo: {exc}") from None
    return Goal(preset.name if preset else None, {**(preset.slos_ms if preset else {}), **explicit})


def run_slos(runs: tuple[RunData, ...], doctor_slos: dict[str, float]) -> dict[str, float]:
    """The SLOs in force: the doctor's own, else the tightest of each metric given to bench."""
    if doctor_slos:
        return dict(doctor_slos)
    merged: dict[str, float] = {}
    for run in runs:
        for key, value in run.slos_ms.items():
            if value:
                merged[key] = min(float(value), merged.get(key, float(value)))
    return merged


def good_fraction(run: RunData, slos: dict[str, float]) -> float | None:
    """Share of the run's requests meeting the SLOs; None without requests or without any SLO to check."""
    if not run.records or not slos:
        return None
    return sum(meets_slo(r, slos) for r in run.records) / len(run.records)


def meets(run: RunData, slos: dict[str, float]) -> bool | None:
    fraction = good_fraction(run, slos)
    return None if fraction is None else fraction >= GOOD_FRACTION


def busiest_meeting(runs: list[RunData], slos: dict[str, float]) -> RunData | None:
    """Of `runs`, the one with the most requests in flight that met the SLOs (the capacity at this goal)."""
    return max((r for r in runs if meets(r, slos)), key=lambda r: r.in_flight, default=None)


def format_slos(slos: dict[str, float]) -> str:
    return ", ".join(f"{k} <= {v:,.0f} ms" for k, v in slos.items()) or "none"


def slo_lines(runs: tuple[RunData, ...], slos: dict[str, float]) -> list[str]:
    """Headroom lines: for each load measured, the share of requests within the SLOs, and the highest
    load that met them (the capacity at this goal)."""
    if not slos:
        return []
    steady = [r for r in runs if r.ok and not r.burst]
    parts = [f"{fraction:.0%} at {run.in_flight:.1f} in flight" for run in steady
             if (fraction := good_fraction(run, slos)) is not None]
    best = busiest_meeting(steady, slos)
    if not parts:
        return []
    capacity = (f"; met up to {best.in_flight:.1f} in flight ({best.output_throughput:,.1f} tok/s)"
                if best is not None else f"; met at no load measured (target: {GOOD_FRACTION:.0%} of requests)")
    return [f"SLOs ({format_slos(slos)}): requests within them {', '.join(parts)}{capacity}"]
