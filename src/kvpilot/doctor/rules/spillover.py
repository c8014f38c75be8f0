"""memory-spillover: the server's working set in swap or host memory, and the step-time rules' deferral to it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.signals import median, ratio


@dataclass(frozen=True)
class _SpillVerdict:
    """How directly the evidence ties a spill to the server's speed: which tier, how bad, how sure."""

    tier: str  # "process" (kvpilot's own pages in swap), "engine" (vLLM swap space / CPU KV), "host"
    severity: Severity
    confidence: float
    summary: str


def _decode_efficiency(ctx: RuleContext) -> float | None:
    """Roofline TPOT floor / median TPOT of the lowest-load run (None without --model/--gpu)."""
    roof, runs = ctx.inputs.roofline, ctx.inputs.runs
    tpot = median(r.tpot_ms for r in runs[0].ok) if runs else None
    return ratio(roof.decode_step_ms, tpot) if roof is not None else None


def _decode_slow(ctx: RuleContext) -> bool:
    efficiency = _decode_efficiency(ctx)
    return efficiency is not None and efficiency < ctx.th.spillover_roofline_efficiency


def _near_roofline(ctx: RuleContext) -> bool:
    """Decode runs at >= twice ``spillover_roofline_efficiency`` of the roofline: whatever spilled,
    it is not what limits speed (memory-spillover stays silent then)."""
    efficiency = _decode_efficiency(ctx)
    return efficiency is not None and efficiency >= 2 * ctx.th.spillover_roofline_efficiency


def server_in_swap(ctx: RuleContext) -> bool:
    """The server process's own pages are in swap (``kvpilot:process_swap_bytes``) and on its step
    path: it reads pages back from disk while generating, or decode is far below the roofline (and
    not near it). This slows every step, so the step-time rules defer to memory-spillover
    (:func:`defer_to_swap`) when it holds; memory-spillover then always reports it, high."""
    view, th = ctx.view, ctx.th
    swapped = (view.process_swap_share or 0.0) >= th.process_swap_share
    hot = (view.major_faults_per_token or 0.0) >= th.spill_major_faults_per_token
    return swapped and (hot or _decode_slow(ctx)) and not _near_roofline(ctx)


SWAP_DEFERRED_CONFIDENCE = 0.4  # below memory-spillover's 0.9 at any impact: 0.4 x 1.5 < 0.9 x 1.0


def defer_to_swap(ctx: RuleContext, finding: Finding) -> Finding:
    """A step-time symptom (slow decode or prefill, stalls, blocked first tokens) on a server that
    reads its own pages back from swap on every step: the swap explains (or at least inflates) it, so
    the finding keeps its evidence but ranks below memory-spillover (confidence at most
    ``SWAP_DEFERRED_CONFIDENCE``) and says why. Unchanged when :func:`server_in_swap` does not hold."""
    if not server_in_swap(ctx):
        return finding
    summary = finding.summary.removesuffix(".") + " (the server reads its own pages back from swap on every " \
        "step, which slows every step: see memory-spillover)."
    return replace(finding, confidence=min(finding.confidence, SWAP_DEFERRED_CONFIDENCE), summary=summary,
                   defers_to="memory-spillover")


def _process_verdict(ctx: RuleContext) -> _SpillVerdict | None:
    """The strongest evidence: the server's own memory in swap, hot (read back while it generates),
    cold (measured: no reads), or not known (no interval or counter to tell)."""
    view, th = ctx.view, ctx.th
    share = view.process_swap_share
    if share is None or share < th.process_swap_share:
        return None
    gib, faults = (view.process_swap_bytes or 0.0) / 2**30, view.major_faults_per_token
    what = f"{gib:.2f} GiB ({share:.0%}) of the server process's memory is in swap"
    if server_in_swap(ctx):
        reads = (f"it waited for the disk {faults:.1f} times per generated token (major page faults)"
                 if faults is not None and faults >= th.spill_major_faults_per_token
                 else "decode runs far below the hardware limit")
        return _SpillVerdict("process", Severity.HIGH, 0.9,
                             f"{what}, and {reads}: every decode step waits for the disk.")
    if faults is not None:
        return _SpillVerdict("process", Severity.LOW, 0.6,
                             f"{what}, but it took only {faults:.2f} major page faults per generated token: cold "
                             "pages, not the bottleneck now (traffic that touches them would stall).")
    how = "scrape /metrics before and after the load" + (
        "" if ctx.inputs.roofline is not None else ", or give --model/--gpu for the roofline")
    return _SpillVerdict("process", Severity.MEDIUM, 0.6,
                         f"{what}; whether decode reads it back from disk is unknown ({how}).")


def _engine_verdict(ctx: RuleContext) -> _SpillVerdict | None:
    """vLLM's own slower tier: requests swapped to CPU, or KV blocks in CPU memory."""
    view = ctx.view
    if not ((view.swapped or 0.0) > 0 or (view.cpu_kv_usage or 0.0) > 0):
        return None
    slow = _decode_slow(ctx)
    return _SpillVerdict("engine", Severity.HIGH if slow else Severity.MEDIUM, 0.85 if slow else 0.55,
                         "Part of the KV cache lives in host memory (requests swapped to CPU)")


def _host_verdict(ctx: RuleContext) -> _SpillVerdict | None:
    """Host swap in use: the weakest evidence, the pages may be another process's. When the server
    reports its own swap and it is below the bar, they are: a low note."""
    view = ctx.view
    if not (view.swap_used_bytes or 0.0) > 0:
        return None
    gib = (view.swap_used_bytes or 0.0) / 2**30
    if view.process_swap_share is not None:  # below the bar, or _process_verdict would have answered
        return _SpillVerdict("host", Severity.LOW, 0.4,
                             f"The host has {gib:.2f} GiB in swap, but only {view.process_swap_share:.0%} of the "
                             "server process's memory is there: mostly other processes' pages.")
    slow = _decode_slow(ctx)
    return _SpillVerdict("host", Severity.HIGH if slow else Severity.MEDIUM, 0.6 if slow else 0.4,
                         f"The host has {gib:.2f} GiB in swap (whose pages is not known: the server does not "
                         "report its own)")


def _spill_evidence(ctx: RuleContext) -> list[Evidence]:
    view = ctx.view
    out = []
    if view.process_swap_share is not None and view.process_swap_bytes is not None:
        out += [Evidence("server process memory in swap", view.process_swap_bytes / 2**30, "GiB",
                         "kvpilot:process_swap_bytes"),
                Evidence("share of the server process's memory in swap", view.process_swap_share, "%",
                         "kvpilot:process_swap_bytes / (swap + process_resident_bytes)")]
    if view.major_faults_per_token is not None:
        out.append(Evidence("major page faults per generated token", view.major_faults_per_token, "",
                            "kvpilot:process_major_page_faults_total"))
    for name, value, unit in (("requests swapped to CPU", view.swapped, ""),
                              ("CPU KV-cache usage", view.cpu_kv_usage, "%"),
                              ("host swap in use", (view.swap_used_bytes or 0.0) / 2**30, "GiB")):
        if value is not None and value > 0:
            out.append(Evidence(name, value, unit, view.source))
    return out


_ENGINE_FIXES = (Fix("keep KV and weights in device memory: no CPU swap space or offload",
                     vllm="--swap-space 0 --cpu-offload-gb 0"),
                 Fix("size the KV cache to what the device holds", kvpilot="--kv-cache-memory <fits in RAM>",
                     vllm="--gpu-memory-utilization 0.9"))
_PROCESS_FIXES = (Fix("size weights + KV cache to the RAM the server may use (its container or cgroup limit)",
                      kvpilot="--kv-cache-memory <RAM limit - weights - 1 GiB>"),
                  Fix("hold the weights in fewer bytes: bfloat16 halves a float32 model",
                      kvpilot="--dtype bfloat16", vllm="--quantization fp8"),
                  Fix("give the server more RAM, or move other memory-hungry processes off its host"))
_COMMON_FIXES = (Fix("disable swap for the server (swapoff -a, or memory.swap.max=0 in its cgroup): an "
                     "over-committed server then fails at start-up instead of running slowly"),
                 Fix("use a smaller or quantized model", kvpilot="--model <Q4/Q8 GGUF>", vllm="--quantization fp8"))


def memory_spillover(ctx: RuleContext) -> Finding | None:
    """The working set lives partly in a slower tier. Evidence, strongest first: the server process's
    own pages in swap and read back while it generates (kvpilot's /proc gauges), vLLM's CPU swap space
    or KV offload, host swap (weakest: it may be another process's). No finding when decode runs near
    the roofline anyway (at least twice ``spillover_roofline_efficiency``)."""
    roof = ctx.inputs.roofline
    if _near_roofline(ctx):
        return None  # spill exists but decode runs near the limit: not the bottleneck
    efficiency = _decode_efficiency(ctx)
    verdict = _process_verdict(ctx) or _engine_verdict(ctx) or _host_verdict(ctx)
    if verdict is None:
        return None
    evidence = _spill_evidence(ctx)
    if efficiency is not None and roof is not None:
        evidence.append(Evidence(f"decode speed vs roofline ({roof.model} on {roof.gpu})", efficiency, "%"))
    summary = verdict.summary
    if verdict.tier != "process":
        summary += (f", and decode runs at {efficiency:.0%} of the hardware limit." if efficiency is not None
                    else "; compare with the roofline (--model, --gpu) to see what it costs.")
    fixes = (*_ENGINE_FIXES, *_PROCESS_FIXES) if verdict.tier == "engine" else (*_PROCESS_FIXES, *_ENGINE_FIXES)
    return Finding(
        rule_id="memory-spillover", title="Memory spills to host RAM or swap",
        severity=verdict.severity, confidence=verdict.confidence,
        impact=clamp01(1 - efficiency if efficiency is not None else 0.5),
        summary=summary, evidence=tuple(evidence), fixes=(*fixes, *_COMMON_FIXES))
