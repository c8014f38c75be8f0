"""``kvpilot doctor --serve CMD --verify``: turn the top finding's fix into a measurement.

Start the server from CMD, probe it, and try the concrete flag fixes of the findings above low
severity, in rank order, one at a time: restart with the fix applied, probe the same workload (same
prompt seed), and compare the metric that fix's finding is about. A fix that does not improve it by
``MIN_GAIN`` is withdrawn and the next is tried, until one helps, the fixes run out, or the next
round would overrun the time budget (the last round's duration predicts the next). A top finding
without a flag fix (cpu-starvation: move the other processes) leaves the next finding's fixes.

A trial whose change lies within NOISE_BAND of none (either way) is measured once more, if the budget allows:
the original command and the fix are each probed again and the trial is judged on the mean of both probes of
each (the staged background loads of the fault matrix moved one cell's "before" by a third between runs).

A fix that shows no gain while the doctor measured the host starving the server (cpu-starvation in the
probe before or after it) is not withdrawn but left undecided, and no further fix is tried: other
processes' load moves every latency by more than ``MIN_GAIN``, so no before/after there tells a fix
that helps from one that does not.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from kvpilot.doctor.diagnose import DoctorReport, diagnose
from kvpilot.doctor.engines import KVPILOT, VLLM
from kvpilot.doctor.findings import Finding, Fix, Severity
from kvpilot.doctor.inputs import DoctorInputs, RunData
from kvpilot.doctor.probe import ProbeSession, check_endpoint, probe_endpoint
from kvpilot.doctor.probe_plan import RAMP_PREFIX, ProbeLimits, ramp_level
from kvpilot.doctor.serve import engine_of, served
from kvpilot.doctor.server_config import from_serve_flags
from kvpilot.doctor.signals import median, quantile
from kvpilot.doctor.slo import Goal, good_fraction, run_slos

MIN_GAIN = 0.1
"""A fix must move its finding's metric by at least this share (beyond run-to-run noise on a CPU)."""
NOISE_BAND = 2 * MIN_GAIN
"""A change smaller than this either way is measured again before it is judged."""


@dataclass(frozen=True)
class Metric:
    """What a finding is about, measured on the probe's inputs; ``lower_is_better`` sets the sign."""

    name: str
    unit: str
    lower_is_better: bool
    measure: Callable[[DoctorInputs], float | None]


def _top_ramp(inputs: DoctorInputs) -> RunData | None:
    """The probe's highest ramp point (the same load before and after a fix), else the busiest run."""
    ramps = [r for r in inputs.runs if r.source.startswith(RAMP_PREFIX)]
    if ramps:
        return max(ramps, key=lambda r: ramp_level(r.source) or 0)
    return max(inputs.runs, key=lambda r: r.in_flight, default=None)


def _low_ramp(inputs: DoctorInputs) -> RunData | None:
    """The probe's lowest ramp point (its baseline, one stream), else the least busy run."""
    ramps = [r for r in inputs.runs if ramp_level(r.source) is not None]
    if ramps:
        return min(ramps, key=lambda r: ramp_level(r.source) or 0)
    return min(inputs.runs, key=lambda r: r.in_flight, default=None)


def _low_tpot(inputs: DoctorInputs) -> float | None:
    run = _low_ramp(inputs)
    return median(r.tpot_ms for r in run.ok) if run is not None else None


def _peak(inputs: DoctorInputs, key: str) -> float | None:
    run = _top_ramp(inputs)
    return median(getattr(r, key) for r in run.ok) if run is not None else None


def _peak_throughput(inputs: DoctorInputs) -> float | None:
    run = _top_ramp(inputs)
    return run.output_throughput if run is not None else None


def _phase_runs(inputs: DoctorInputs, name: str) -> list[RunData]:
    return [r for r in inputs.runs if r.source == f"probe:{name}"]


def _phase(inputs: DoctorInputs, name: str, key: str) -> float | None:
    runs = _phase_runs(inputs, name)
    return median(getattr(r, key) for run in runs for r in run.ok) if runs else None


def _shorts_ttft(inputs: DoctorInputs) -> float | None:
    return median(r.ttft_ms for run in _phase_runs(inputs, "long-short") for r in run.ok if r.group_id != "long")


# A batch or admission cap limits how much work gets done at the top load: with it raised, requests the
# server refused (HTTP 429) are admitted and wait, so their TTFT can rise while the service improves.
THROUGHPUT = Metric("output throughput at the highest load", "tok/s", False, _peak_throughput)
TTFT_AT_PEAK = Metric("median TTFT at the highest load", "ms", True, lambda i: _peak(i, "ttft_ms"))
PEAK_TPOT = Metric("median TPOT at the highest load", "ms", True, lambda i: _peak(i, "tpot_ms"))
SHARED_PREFIX_TTFT = Metric("median TTFT of shared-prefix requests", "ms", True,
                            lambda i: _phase(i, "shared-prefix", "ttft_ms"))


def _reuse_ttft(inputs: DoctorInputs) -> float | None:
    """Median TTFT of requests that could reuse a cached prefix: multi-turn sessions' returning turns, else the
    probe's shared-prefix phase (what a KV offload tier speeds up)."""
    returning = [r.ttft_ms for run in inputs.runs for r in run.ok if r.turn_index > 0]
    return median(returning) if returning else _phase(inputs, "shared-prefix", "ttft_ms")


REUSE_TTFT = Metric("median TTFT of requests reusing a prefix", "ms", True, _reuse_ttft)
E2E_AT_PEAK = Metric("median E2E at the highest load", "ms", True, lambda i: _peak(i, "e2e_ms"))
MIN_GAPS = 20
"""A p99 of fewer inter-token gaps is one request's accident, not a measure."""


def _gaps_p99(runs: list[RunData]) -> float | None:
    """p99 of every gap between streamed tokens of the runs' requests: the stall a step carrying a long prefill
    puts into each running stream (a chunk cap splits it into short ones with the same prefill work, so a
    median TPOT hardly moves)."""
    gaps = [gap for run in runs for r in run.ok for gap in r.itl_ms]
    return quantile(gaps, 0.99) if len(gaps) >= MIN_GAPS else None


def _peak_itl_p99(inputs: DoctorInputs) -> float | None:
    run = _top_ramp(inputs)
    return _gaps_p99([run] if run is not None else [])


PEAK_ITL_P99 = Metric("p99 inter-token gap at the highest load", "ms", True, _peak_itl_p99)
OFFLOAD_FLAG = "--kv-offloading-size"
METRICS: dict[str, Metric] = {
    "prefix-recomputed": REUSE_TTFT,
    # queueing is the wait for a slot, inside TTFT: on a compute-bound host a larger batch barely raises throughput
    # while the queue wait it removes is most of the TTFT
    "queueing": TTFT_AT_PEAK, "static-batching": THROUGHPUT,
    # a short KV pool preempts requests as their KV grows, after their first token: the recompute shows in E2E,
    # while a larger pool admits more at once, which can lengthen each step and so the TTFT
    "kv-cache-pressure": E2E_AT_PEAK, "kv-pool-too-small": E2E_AT_PEAK, "max-num-seqs-over-kv": E2E_AT_PEAK,
    "token-budget-below-seqs": PEAK_TPOT, "decode-bound": PEAK_TPOT,
    "prefix-cache-miss": SHARED_PREFIX_TTFT, "prefix-caching-off": SHARED_PREFIX_TTFT,
    "long-short-mixing": Metric("median TTFT of short requests beside long ones", "ms", True, _shorts_ttft),
    "prefill-interrupts-decode": Metric("p99 inter-token gap beside long prompts", "ms", True,
                                        lambda i: _gaps_p99(_phase_runs(i, "long-short"))),
    # speculation is judged where it acts: the busiest load (costs) and one stream (n-gram copying)
    "speculation-costs": THROUGHPUT,
    "prompt-copying": Metric("median TPOT at the lowest load", "ms", True, _low_tpot),
}
DEFAULT_METRIC = E2E_AT_PEAK
JUDGED_BY: dict[str, Metric] = {"peak-itl-p99": PEAK_ITL_P99}  # Finding.judged_by's names


def _within_slos(inputs: DoctorInputs) -> float | None:
    run = _top_ramp(inputs)
    slos = run_slos(inputs.runs, inputs.slos_ms)
    return good_fraction(run, slos) if run is not None and slos else None


WITHIN_SLOS = Metric("share of requests within the SLOs at the highest load", "", False, _within_slos)


def metric_for(rule_id: str, workload: str | None = None, flags: tuple[str, ...] | list[str] = (),
               judged_by: str = "") -> Metric:
    """What a trial of ``rule_id``'s fix (``flags``) is judged by; workload tuning by its goal (throughput for
    batch); a KV offload tier by the requests that reuse a prefix, whichever finding proposed it; a finding that
    names its measure (``Finding.judged_by``: other clients' long prompts stall the probe's streams at the
    busiest load, not in the long-short phase, which measures the probe's own) by that one."""
    if rule_id == "workload-tuning":
        return THROUGHPUT if workload == "batch" else WITHIN_SLOS
    if OFFLOAD_FLAG in flags:
        return REUSE_TTFT
    if judged_by:
        return JUDGED_BY[judged_by]
    return METRICS.get(rule_id, DEFAULT_METRIC)


def fix_flags(fix: Fix, engine: str) -> list[str] | None:
    """The fix as flags for ``engine``: vLLM's or kvpilot's, or for another engine (llama-server, SGLang, TGI)
    the translation the diagnosis gave it (engine_flags.localize_fixes, from the server it probed); None when it
    is not a concrete flag change (placeholders, prose, another process, no counterpart there)."""
    if engine in (VLLM, KVPILOT):
        text = fix.vllm if engine == VLLM else fix.kvpilot
    else:
        text = fix.engine_flags if fix.engine == engine else ""
    if not text.startswith("--") or "<" in text or "(" in text:
        return None
    return shlex.split(text)


def apply_flags(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` with each ``--flag [value]`` of ``flags`` set (replacing an earlier value, and the
    ``--no-`` form of a boolean flag)."""
    out = list(argv)
    i = 0
    while i < len(flags):
        name = flags[i].split("=", 1)[0]
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
        out = _without(out, name)
        out = _without(out, "--no-" + name[2:]) if not name.startswith("--no-") else _without(out, "--" + name[5:])
        out += [flags[i]] + ([value] if value is not None else [])
        i += 2 if value is not None else 1
    return out


def _without(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for j, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == name:
            skip = j + 1 < len(argv) and not argv[j + 1].startswith("--")
            continue
        if arg.startswith(name + "="):
            continue
        out.append(arg)
    return out


@dataclass(frozen=True)
class Trial:
    """One restart with a fix: the metric before and after, and whether the fix is kept."""

    rule_id: str
    flags: tuple[str, ...]
    before: float | None
    after: float | None
    finding_after: str  # "gone", or the severity it still has
    kept: bool
    wall_s: float
    metric: Metric = DEFAULT_METRIC
    host_busy: tuple[str, ...] = ()  # the probes ("before", "after") in which the doctor found the CPU starved
    num_probes: int = 1  # probes of each side before and after averaged (2: a borderline change measured again)

    @property
    def undecided(self) -> bool:
        """No gain measured, but on a host too busy for a before/after to show one."""
        return not self.kept and bool(self.host_busy)

    @property
    def change(self) -> float | None:
        return (self.after - self.before) / self.before if self.before and self.after is not None else None


@dataclass
class VerifyResult:
    """The baseline diagnosis and every trial (in the order tried); ``finding`` and ``metric`` are
    those of the last trial (or the top finding when none ran)."""

    report: DoctorReport
    session: ProbeSession
    finding: Finding | None
    metric: Metric | None
    trials: list[Trial] = field(default_factory=list)
    stopped: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"finding": self.finding.rule_id if self.finding else None,
                "metric": self.metric.name if self.metric else None,
                "trials": [{"rule_id": t.rule_id, "flags": list(t.flags), "metric": t.metric.name,
                            "before": t.before, "after": t.after,
                            "change": t.change,
                            "finding_after": t.finding_after, "kept": t.kept, "undecided": t.undecided,
                            "host_busy": list(t.host_busy), "probes": t.num_probes, "wall_s": round(t.wall_s, 1)}
                           for t in self.trials], "stopped": self.stopped}


def _probe(argv: list[str], limits: ProbeLimits, console: Console, seed: int, timeout_s: float,
           model: str | None, gpu: str | None, goal: Goal) -> tuple[ProbeSession, DoctorReport]:
    with served(argv, timeout_s) as server:
        endpoint = check_endpoint(server.base_url)
        session = probe_endpoint(endpoint, limits, console, seed=seed, server_pids=server.pids,
                                 extra_config=from_serve_flags(argv))
    return session, diagnose(goal.apply(session.inputs(model, gpu)))


def _gain(metric: Metric, before: float | None, after: float | None) -> float | None:
    """The improvement as a share of before (negative: worse), None when either is unknown."""
    if before is None or after is None or before <= 0:
        return None
    return (before - after) / before if metric.lower_is_better else (after - before) / before


def _helped(metric: Metric, before: float | None, after: float | None) -> bool:
    gain = _gain(metric, before, after)
    return gain is not None and gain >= MIN_GAIN


def _mean(a: float | None, b: float | None) -> float | None:
    return (a + b) / 2 if a is not None and b is not None else a if b is None else b


STARVED = "cpu-starvation"


def _host_busy(before: DoctorReport, after: DoctorReport) -> tuple[str, ...]:
    """The probes of a trial whose diagnosis found the server starved of CPU by other processes."""
    return tuple(name for name, report in (("before", before), ("after", after))
                 if any(f.rule_id == STARVED for f in report.findings))


def _candidates(report: DoctorReport, engine: str) -> list[tuple[Finding, list[str]]]:
    """(finding, flags) for every concrete flag fix of the findings above low severity, in rank order
    (a top finding with no flag fix, like cpu-starvation, leaves the next finding's fixes to try), then
    the `--workload` recommendation (low severity: a goal, not a fault, so it is tried last)."""
    tried = [f for f in report.findings if f.severity is not Severity.LOW or f.rule_id == "workload-tuning"]
    return [(f, flags) for f in tried for fix in f.fixes if (flags := fix_flags(fix, engine)) is not None]


def run_verify(command: list[str], limits: ProbeLimits, console: Console, seed: int, budget_s: float,
               serve_timeout_s: float, model: str | None = None, gpu: str | None = None,
               goal: Goal | None = None) -> VerifyResult:
    """Baseline probe, then trials of the findings' fixes within ``budget_s`` seconds in all."""
    started = time.monotonic()
    goal = goal or Goal()
    session, report = _probe(command, limits, console, seed, serve_timeout_s, model, gpu, goal)
    candidates = _candidates(report, engine_of(command))
    above_low = [f for f in report.findings if f.severity is not Severity.LOW]
    top = candidates[0][0] if candidates else (above_low[0] if above_low else None)
    metric = metric_for(top.rule_id, goal.workload, judged_by=top.judged_by) if top else None
    result = VerifyResult(report, session, top, metric)
    if not candidates:
        result.stopped = "healthy: nothing to verify" if top is None else "no concrete flag fix to try"
        return result
    round_s = time.monotonic() - started
    # Every restart repeats the ramp points the first probe ran (its knee), so before and after compare the
    # same loads.
    ran = tuple(p.phase.load.concurrency or 1 for p in session.phases if p.phase.name.startswith("ramp-"))
    limits = limits.fixed_ramp((1, *ran))
    for finding, flags in candidates:
        if time.monotonic() - started + round_s > budget_s:
            result.stopped = f"time budget of {budget_s:.0f} s reached"
            break
        metric = metric_for(finding.rule_id, goal.workload, flags, finding.judged_by)
        result.finding, result.metric = finding, metric
        t0 = time.monotonic()
        console.print(f"verify: restarting with {' '.join(flags)} ({finding.rule_id})", markup=False)
        after_session, after_report = _probe(apply_flags(command, flags), limits, console, seed, serve_timeout_s,
                                             model, gpu, goal)
        before = metric.measure(goal.apply(session.inputs()))
        after = metric.measure(goal.apply(after_session.inputs()))
        num_probes = 1
        gain = _gain(metric, before, after)
        if gain is not None and abs(gain) < NOISE_BAND and \
                time.monotonic() - started + 3 * (time.monotonic() - t0) <= budget_s:
            console.print(f"verify: {gain:+.0%} is within the noise band: measuring both again", markup=False)
            again_before, _ = _probe(command, limits, console, seed, serve_timeout_s, model, gpu, goal)
            again_after, _ = _probe(apply_flags(command, flags), limits, console, seed, serve_timeout_s, model, gpu,
                                    goal)
            before = _mean(before, metric.measure(goal.apply(again_before.inputs())))
            after = _mean(after, metric.measure(goal.apply(again_after.inputs())))
            num_probes = 2
        still = next((f for f in after_report.findings if f.rule_id == finding.rule_id), None)
        helped = _helped(metric, before, after)  # the finding may remain (a 2x cap still queues), smaller
        round_s = (time.monotonic() - t0) / (2 * num_probes - 1)  # one probe: what a next trial's first costs
        trial = Trial(finding.rule_id, tuple(flags), before, after, still.severity.value if still else "gone",
                      helped, time.monotonic() - t0, metric, _host_busy(report, after_report), num_probes)
        result.trials.append(trial)
        if helped:
            result.stopped = "a fix helped"
            break
        if trial.undecided:
            result.stopped = (f"host too busy to judge: other processes starved the server of CPU in the "
                              f"{' and '.join(trial.host_busy)} probe; rerun on a quiet machine")
            break
    else:
        result.stopped = "no fix helped measurably"
    return result


def print_verify(console: Console, result: VerifyResult) -> None:
    """Before/after lines for the finding's metric, one per trial."""
    if result.finding is None or result.metric is None:
        console.print(f"verify: {result.stopped}", markup=False)
        return
    for t in result.trials:
        m = t.metric
        console.print(f"verify {t.rule_id}: {m.name} ({m.unit}, {'lower' if m.lower_is_better else 'higher'} "
                      "is better)", markup=False)
        before = f"{t.before:,.1f}" if t.before is not None else "n/a"
        after = f"{t.after:,.1f}" if t.after is not None else "n/a"
        change = f" ({t.change:+.0%})" if t.change is not None else ""
        verdict = "kept: it helps" if t.kept else (
            f"undecided: the CPU was starved in the {' and '.join(t.host_busy)} probe" if t.undecided
            else "withdrawn: no measurable help")
        probes = " (means of 2 probes each)" if t.num_probes > 1 else ""
        console.print(f"  {' '.join(t.flags)}: before {before}, after {after}{change}{probes}; finding after: "
                      f"{t.finding_after}; {verdict} ({t.wall_s:.0f} s)", markup=False)
    console.print(f"verify: {result.stopped}", markup=False)
