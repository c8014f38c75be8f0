"""Rule: the run was far below this machine's own limits, so it is not healthy even when no stage stands out.

A server starved by other processes for a whole run slows every stage alike: no stage dominates, no rule
fires, and the report used to say "healthy" over 24 tok/s from a server that made 449 a few minutes later.
Two references say what this machine can do, each judged with a wide margin:

* **the run's own best window** (kvpilot.doctor.windows): the fastest stretch of the run at its typical
  load; most of the run at a third of it or less is the host, not the configuration (which is the same in
  every window);
* **the served roofline** (on a CPU, the model and device kvpilot's capacity endpoint names): even the run's
  fastest requests (p10 TPOT) at a twentieth of the roofline's step time at their batch. A roofline given with
  ``--model/--gpu`` is decode-bound's to judge (its efficiency bar is 30%); this rule does not repeat it.

Neither needs the host's /proc, so saved bench files get the verdict too; when the doctor did measure the
host and found the cause (cpu-starvation, memory-spillover), this finding defers to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.foreign_prefill import measure_foreign_prefill
from kvpilot.doctor.rules.spillover import server_in_swap
from kvpilot.doctor.rules.starvation import host_starved
from kvpilot.doctor.signals import quantile
from kvpilot.doctor.windows import window_speed


@dataclass(frozen=True)
class Shortfall:
    """One reference the run fell far below: ``share`` = measured speed / reference speed."""

    share: float
    bar: float
    text: str
    evidence: tuple[Evidence, ...]


def _window_shortfall(ctx: RuleContext) -> Shortfall | None:
    """The run whose typical window was slowest next to its own best one, when past the bar."""
    th, worst = ctx.th, None
    for run in ctx.inputs.runs:
        speed = window_speed(run.ok) if len(run.ok) >= th.min_requests else None
        if speed is None or speed.tokens_best < th.min_best_window_tokens:
            continue
        if worst is None or speed.typical_share < worst[1].typical_share:
            worst = (run, speed)
    bar = 1.0 / th.own_best_window_ratio
    if worst is None or worst[1].typical_share > bar:
        return None
    run, s = worst
    text = (f"in run '{run.label}' the server delivered {s.typical:,.1f} tok/s in a typical {s.window_s:.0f}-s window "
            f"but {s.best:,.1f} tok/s in its best one at the same load: it ran at {s.typical_share:.0%} of the speed "
            "it showed in this very run for most of it")
    return Shortfall(s.typical_share, bar, text, (
        Evidence("typical window throughput", s.typical, "tok/s", f"run '{run.label}'"),
        Evidence("best window throughput", s.best, "tok/s", f"run '{run.label}'"),
        Evidence("windows at the typical load", s.num_windows),
        Evidence("typical / best", s.typical_share, "%")))


def _roofline_step_ms(ctx: RuleContext, run: RunData) -> float | None:
    """The served roofline's decode step time at ``run``'s batch, when it may be judged by (no --model/--gpu
    roofline, the server on a CPU) and the run is at batch 1 or at the roofline's batch."""
    served, cfg = ctx.inputs.served_roofline, ctx.inputs.server_config
    roof = served if ctx.inputs.roofline is None and cfg is not None and cfg.fit_device == "cpu" else None
    if roof is None:
        return None
    if run.in_flight <= 2.0:
        return roof.decode_step_ms
    if run is ctx.inputs.peak_run and roof.aggregate_tokens_per_s > 0:
        return roof.batch_size / roof.aggregate_tokens_per_s * 1000.0
    return None


def _roofline_shortfall(ctx: RuleContext) -> Shortfall | None:
    """The run whose fastest requests (p10 TPOT) were furthest below the roofline, when past the bar."""
    th, worst = ctx.th, None
    for run in ctx.inputs.runs:
        floor = _roofline_step_ms(ctx, run) if len(run.ok) >= th.min_requests else None
        fast = quantile([r.tpot_ms for r in run.ok], 0.1) if floor is not None else None
        if floor is None or not fast:
            continue
        if worst is None or floor / fast < worst[0]:
            worst = (floor / fast, run, floor, fast)
    if worst is None or worst[0] >= th.far_below_roofline:
        return None
    share, run, floor, fast = worst
    text = (f"in run '{run.label}' even the fastest requests decoded a token every {fast:,.1f} ms (p10 TPOT) where "
            f"the roofline takes {floor:,.1f} ms at that batch: {share:.0%} of this machine's limit")
    return Shortfall(share, th.far_below_roofline, text, (
        Evidence("p10 TPOT", fast, "ms", f"run '{run.label}'"),
        Evidence("roofline step time at that batch", floor, "ms", "kvpilot fit"),
        Evidence("decode speed vs roofline", share, "%")))


def _cause(ctx: RuleContext) -> str:
    """A cause the doctor measured, which explains the shortfall ("" when none was measured): the host, or
    other clients' long prompts prefilled in the measured decodes' steps (seen in the server's metrics)."""
    if host_starved(ctx):
        return "cpu-starvation"
    if server_in_swap(ctx):
        return "memory-spillover"
    foreign = measure_foreign_prefill(ctx)
    return "prefill-interrupts-decode" if foreign is not None and foreign.engine_share >= ctx.th.long_prefill_share \
        else ""


def degraded_run(ctx: RuleContext) -> Finding | None:
    """The run was far below a speed this machine reached (its own best window) or allows (the roofline)."""
    found = [s for s in (_window_shortfall(ctx), _roofline_shortfall(ctx)) if s is not None]
    if not found:
        return None
    worst = min(found, key=lambda s: s.share / s.bar)  # the furthest past its own bar
    cause = _cause(ctx)
    why = (f" The doctor measured why: see {cause}." if cause else " Something else had the machine: other "
           "processes, swap, CPU throttling or a noisy neighbour; the configuration is not the limit.")
    return Finding(
        rule_id="degraded-run", title="The run was far below this machine's own speed",
        severity=Severity.HIGH if worst.share < worst.bar / 2 else Severity.MEDIUM,
        confidence=0.8 if len(found) == 2 else 0.7, impact=clamp01(1.0 - worst.share),
        summary="; ".join(s.text[:1].upper() + s.text[1:] if i == 0 else s.text for i, s in enumerate(found))
        + "." + why,
        evidence=tuple(e for s in found for e in s.evidence),
        fixes=(Fix("find what else ran on the host during the run and measure again when it is quiet",
                   kvpilot="kvpilot doctor --url http://<server>:8000 (measures the host: cpu-starvation, swap)"),
               Fix("keep other work off the server's cores", kvpilot="taskset -c <cores> kvpilot serve ...",
                   vllm="taskset -c <cores> vllm serve ...")),
        defers_to=cause, impact_basis="of the speed this machine showed, lost for most of the run")
