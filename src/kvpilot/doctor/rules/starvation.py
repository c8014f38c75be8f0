"""Rule on the server's share of the machine: CPU starvation by other processes or the hypervisor.

Evidence comes from :mod:`kvpilot.doctor.resources` (a local server's /proc over the probe): the
kernel's run-queue delay of the server's threads says how long they were ready to run but had no CPU;
the host's busy and steal shares and the top other processes say who had it instead.
"""

from __future__ import annotations

from dataclasses import replace

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.resources import ResourceUsage
from kvpilot.doctor.rules.context import RuleContext

STARVED_DEFERRED_CONFIDENCE = 0.4


def _starved(r: ResourceUsage | None, ctx: RuleContext) -> tuple[bool, bool]:
    """(waited for CPU behind other processes, the hypervisor stole CPU) by the thresholds."""
    if r is None:
        return False, False
    th = ctx.th
    waited = (r.run_queue_share is not None and r.run_queue_share >= th.cpu_wait_share
              and (r.other_cores or 0.0) >= th.min_other_cores)
    stolen = r.steal_share is not None and r.steal_share >= th.steal_share
    return waited, stolen


def host_starved(ctx: RuleContext) -> bool:
    """Whether cpu-starvation fires at all (the server waited for a CPU behind others, or steal)."""
    return any(_starved(ctx.inputs.resources, ctx))


def server_starved(ctx: RuleContext) -> bool:
    """Whether the server's steps waited so long for a CPU that step-time symptoms are its doing."""
    r = ctx.inputs.resources
    waited, stolen = _starved(r, ctx)
    return r is not None and (waited or stolen) and (r.run_queue_share or 0.0) >= ctx.th.cpu_wait_share_high


def defer_to_starvation(ctx: RuleContext, finding: Finding) -> Finding:
    """A step-time symptom (or the client's lag) on a host where the server waited for a CPU most of
    the time: the starvation explains it, so it keeps its evidence but ranks below cpu-starvation."""
    if not server_starved(ctx):
        return finding
    summary = finding.summary.removesuffix(".") + " (the server's threads waited for a CPU much of the " \
        "time, which slows every step: see cpu-starvation)."
    return replace(finding, confidence=min(finding.confidence, STARVED_DEFERRED_CONFIDENCE), summary=summary,
                   defers_to="cpu-starvation")


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


def _competitor_text(r: ResourceUsage) -> str:
    return ", ".join(f"{c.name} (pid {c.pid}, {c.cores:.2f} cores)" for c in r.competitors)


def cpu_starvation(ctx: RuleContext) -> Finding | None:
    """The server's threads were runnable but waited for a CPU a large share of the time, while other
    processes used the cores (or the hypervisor stole them)."""
    r, th = ctx.inputs.resources, ctx.th
    waited, stolen = _starved(r, ctx)
    if r is None or not (waited or stolen):
        return None
    share = r.run_queue_share or 0.0
    severity = Severity.HIGH if share >= th.cpu_wait_share_high or (r.steal_share or 0) >= 2 * th.steal_share \
        else Severity.MEDIUM
    evidence = [Evidence("server threads' time waiting for a CPU", share, "%", r.source)]
    if r.server_cores is not None:
        evidence.append(Evidence("CPU the server used", r.server_cores, "cores", r.source))
    if r.other_cores is not None:
        evidence.append(Evidence("CPU other processes used", r.other_cores, "cores", "/proc/stat"))
    if r.num_cpus is not None:
        evidence.append(Evidence("CPUs on the host", r.num_cpus))
    if r.host_busy_share is not None:
        evidence.append(Evidence("host CPU busy", r.host_busy_share, "%", "/proc/stat"))
    if r.steal_share:
        evidence.append(Evidence("host CPU stolen by the hypervisor", r.steal_share, "%", "/proc/stat"))
    if r.load_avg_1m is not None:
        evidence.append(Evidence("load average (1 min)", r.load_avg_1m, "", "/proc/loadavg"))
    if r.doctor_cores:
        evidence.append(Evidence("CPU this doctor (the load generator) used", r.doctor_cores, "cores"))
    who = _competitor_text(r)
    parts = []
    if waited:
        parts.append(f"the server's threads were ready to run but waited for a CPU {share:.0%} of the time, "
                     f"while other processes used {r.other_cores:.1f} of {r.num_cpus} cores"
                     + (f" (most: {who})" if who else ""))
    if stolen:
        parts.append(f"the hypervisor took {r.steal_share:.0%} of the host's CPU time (steal)")
    fixes = [Fix("stop or move the competing processes" + (f": {who}" if who else ""),
                 kvpilot="run kvpilot serve on a host (or cores) of its own",
                 vllm="run vllm serve on a host (or cores) of its own"),
             Fix("reserve cores for the server and keep others off them",
                 kvpilot="taskset -c <cores> kvpilot serve ... (others: taskset/cgroup cpu.max elsewhere)",
                 vllm="taskset -c <cores> vllm serve ... (others: taskset/cgroup cpu.max elsewhere)"),
             Fix("or lower the others' priority", kvpilot="renice +10 -p <their pids>",
                 vllm="renice +10 -p <their pids>")]
    if stolen:
        fixes.append(Fix("use an instance with dedicated CPUs (no steal)"))
    if (r.doctor_cores or 0) >= 0.5 * (r.other_cores or 0) and waited:
        fixes.append(Fix("probe from another machine: this doctor's load generator shares the host",
                         kvpilot="kvpilot doctor --url http://<server-host>:8000 (run elsewhere)"))
    return Finding(
        rule_id="cpu-starvation", title="The server does not get the CPU: other processes take it",
        severity=severity, confidence=0.9 if waited else 0.7, impact=clamp01(max(share, r.steal_share or 0.0)),
        impact_basis="of every engine step: the time its threads were runnable without a CPU",
        summary=_sentence("; ".join(parts)) + " Every engine step took longer by that much.",
        evidence=tuple(evidence), fixes=tuple(fixes))
