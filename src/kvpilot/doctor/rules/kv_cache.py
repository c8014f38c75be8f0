"""Rules on memory: KV-cache pressure, prefix-cache misses, spillover to host memory or swap."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.signals import first_token_s, median, ratio


def kv_pressure(ctx: RuleContext) -> Finding | None:
    """KV usage near 100% and/or preemptions (recomputed prefills), often with requests waiting."""
    th, view = ctx.th, ctx.view
    usage, preempt = view.kv_usage_max, view.num_preemptions or 0.0
    full = usage is not None and usage >= th.kv_usage_high
    if not full and preempt <= 0:
        return _filling_up(ctx) if usage is not None and usage >= th.kv_usage_warn else None
    num_finished = len(ctx.inputs.ok_records) or (ctx.inputs.metrics.get("num_finished")
                                                   if ctx.inputs.metrics else None) or 0
    per_request = preempt / num_finished if num_finished else (1.0 if preempt else 0.0)
    waiting = (view.waiting_mean or 0.0) >= th.min_waiting_mean or (view.waiting_max or 0.0) >= 1
    # High when requests are actually held back: a full pool with a queue, or frequent preemptions
    # while the pool is full or requests wait (a few lifetime preemptions alone are a warning).
    often = per_request >= th.preemptions_per_request_high
    severity = Severity.HIGH if (full or waiting) and (often or (full and waiting)) else Severity.MEDIUM
    split = ctx.server_split
    queue_share = ratio(split.queue_ms, split.server_ttft_ms) if split else None
    evidence = [Evidence("KV-cache usage, peak", usage, "%", view.source)] if usage is not None else []
    evidence.append(Evidence("preemptions", preempt, "", view.source))
    if num_finished:
        evidence.append(Evidence("preemptions per request", per_request))
    if view.waiting_max is not None:
        evidence.append(Evidence("requests waiting, max", view.waiting_max, "", view.source))
    if view.running_max is not None:
        evidence.append(Evidence("requests running at most", view.running_max, "", view.source))
    signals = sum([full, preempt > 0, waiting])
    what = " and ".join(p for p in (f"KV cache {usage:.0%} full" if usage is not None else "",
                                    f"{preempt:.0f} preemptions" if preempt else "") if p)
    return Finding(
        rule_id="kv-cache-pressure", title="KV cache is too small for the traffic",
        severity=severity, confidence=min(0.95, 0.5 + 0.2 * signals),
        impact=clamp01(max(queue_share or 0.0, min(1.0, per_request), 0.4)),
        summary=(f"{what}: " + ("new requests cannot get blocks, so they wait" if waiting else
                                "the pool is close to its limit")
                 + (", and running requests are preempted and recomputed" if preempt else "") + "."),
        evidence=tuple(evidence),
        fixes=(Fix("give the KV cache more memory", kvpilot="--kv-cache-memory <2x current>",
                   vllm="--gpu-memory-utilization 0.95 (or --kv-cache-memory-bytes)"),
               Fix("store KV in fewer bits: fp8 halves a 16-bit cache, bfloat16 halves a float32 one",
                   kvpilot="--kv-cache-dtype fp8 (bfloat16 for a float32 model)", vllm="--kv-cache-dtype fp8"),
               Fix("cap the context length so fewer blocks are reserved per request",
                   kvpilot="--max-model-len <longest real request>", vllm="--max-model-len <longest real request>"),
               Fix("run fewer sequences at once: fewer preemptions", kvpilot="--max-num-seqs <lower>",
                   vllm="--max-num-seqs <lower>"),
               Fix("add memory: more GPUs (tensor parallel) or a larger GPU", vllm="--tensor-parallel-size 2")))


def _filling_up(ctx: RuleContext) -> Finding:
    """Low-severity note: the pool has headroom, but not much."""
    usage = ctx.view.kv_usage_max or 0.0
    return Finding(
        rule_id="kv-cache-pressure", title="KV cache is filling up", severity=Severity.LOW,
        confidence=0.5, impact=0.1,
        summary=f"KV cache peaked at {usage:.0%} with no preemptions: fine now, little room for bursts.",
        evidence=(Evidence("KV-cache usage, peak", usage, "%", ctx.view.source),),
        fixes=(Fix("give the KV cache more memory before traffic grows", kvpilot="--kv-cache-memory <larger>",
                   vllm="--gpu-memory-utilization 0.95"),))


def _expected_hit_rate(run: RunData) -> float | None:
    """Share of prompt tokens a perfect prefix cache could have served in a run of bench's
    shared-prefix dataset: the prefix share of each prompt, for every request sent after another
    request of its prefix group had its first token (that prefix was computed and cached by then).
    Requests sent before that (a closed loop's first round sends several of a group at once) cannot
    reuse it in any engine: blocks are shared once computed, not while being prefilled. Without the
    timing, a probe whose one round was all concurrent would "expect" hits no server can give."""
    dataset, ok = run.dataset, run.ok
    if dataset.get("kind") != "shared-prefix" or not ok:
        return None
    prefix, total = float(dataset.get("prefix_len") or 0), float(dataset.get("input_len") or 0)
    if total <= 0:
        return None
    cached_at: dict[str, float] = {}
    for r in ok:
        t = first_token_s(r)
        if r.group_id is not None and t is not None:
            cached_at[r.group_id] = min(t, cached_at.get(r.group_id, math.inf))
    reusable = sum(1 for r in ok if r.group_id in cached_at and r.sent_s >= cached_at[r.group_id])
    return (min(prefix, total) / total) * reusable / len(ok)


def _shared_groups(ctx: RuleContext) -> int:
    """Prefix groups (group_id ``prefix-*``) with more than one request."""
    counts: dict[str, int] = {}
    for r in ctx.inputs.ok_records:
        if r.group_id and r.group_id.startswith("prefix"):
            counts[r.group_id] = counts.get(r.group_id, 0) + 1
    return sum(1 for n in counts.values() if n > 1)


def prefix_cache_miss(ctx: RuleContext) -> Finding | None:
    """Traffic shares prefixes but the server's prefix-cache hit rate is low (or caching is off)."""
    th, view = ctx.th, ctx.view
    expected = max((e for run in ctx.inputs.runs
                    if (e := _expected_hit_rate(run)) is not None), default=None)
    shared = _shared_groups(ctx)
    if expected is None and shared == 0:
        return None
    bar = expected if expected is not None else th.min_expected_hit_rate / th.prefix_hit_share_of_expected
    if bar < th.min_expected_hit_rate:
        return None
    hit, disabled = view.prefix_hit_rate, view.prefix_caching_enabled is False
    if not disabled and (hit is None or hit >= th.prefix_hit_share_of_expected * bar):
        return None
    evidence = [Evidence("prefix groups with repeated prefixes", shared, "", "request group ids")]
    if expected is not None:
        evidence.append(Evidence("achievable hit rate (shared-prefix dataset)", expected, "%"))
    if hit is not None:
        evidence.append(Evidence("measured prefix-cache hit rate", hit, "%", view.source))
    if disabled:
        evidence.append(Evidence("enable_prefix_caching (vllm:cache_config_info)", 0.0))
    lost = (expected or bar) - (hit or 0.0)
    return Finding(
        rule_id="prefix-cache-miss", title="Shared prompt prefixes are recomputed instead of reused",
        severity=Severity.HIGH if disabled or (hit or 0.0) < 0.2 * bar else Severity.MEDIUM,
        confidence=0.9 if disabled or expected is not None else 0.6, impact=clamp01(lost),
        summary=("The traffic repeats prompt prefixes ("
                 + (f"up to {expected:.0%} of prompt tokens reusable" if expected is not None
                    else f"{shared} groups of requests share one") + ") but "
                 + ("prefix caching is disabled." if disabled or hit is None else
                    f"only {hit:.0%} hit the cache: their prefill is recomputed every time.")),
        evidence=tuple(evidence),
        fixes=(Fix("turn prefix caching on", kvpilot="--enable-prefix-caching", vllm="--enable-prefix-caching"),
               Fix("keep the shared part first and byte-identical (no timestamps or ids before it)"),
               Fix("keep cached prefixes from being evicted: more KV memory",
                   kvpilot="--kv-cache-memory <larger>", vllm="--gpu-memory-utilization 0.95"),
               Fix("route requests with the same prefix to the same replica (prefix-aware routing)")))


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
    return replace(finding, confidence=min(finding.confidence, SWAP_DEFERRED_CONFIDENCE), summary=summary)


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
    view, th = ctx.view, ctx.th
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
