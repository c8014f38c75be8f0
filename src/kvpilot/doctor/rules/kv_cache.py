"""Rules on KV memory: KV-cache pressure and prefix-cache misses (swap and host memory: spillover.py)."""

from __future__ import annotations

import math

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.inputs import kv_full_phrase
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.kv_bound import estimated_pool_too_small
from kvpilot.doctor.rules.prefix_reuse import (PrefixReuse, evicted_by_full_pool, expected_hit_rate,
                                               prefix_shortfall, shared_groups)
from kvpilot.doctor.rules.routing import measure_routing
from kvpilot.doctor.signals import ratio

MIB = 2**20


def pool_explains_pressure(ctx: RuleContext) -> float | None:
    """Requests of max_model_len the pool holds, when so few (< ``max_len_requests_high``) that the
    pool's size is the cause of any measured KV pressure; else None."""
    cfg = ctx.inputs.server_config
    held = cfg.max_len_requests if cfg is not None else None
    return held if held is not None and held < ctx.th.max_len_requests_high else None


OFFLOAD_FIX = Fix("keep the prefix blocks the pool evicts in host memory and copy them back on reuse (KV offload)",
                  kvpilot="--kv-offloading-size 2", vllm="--kv-offloading-size 2")


def kv_full_refusals(ctx: RuleContext) -> Finding | None:
    """Requests the server failed because its KV buffer was full: the pool is too small for the traffic in flight,
    whatever its metrics say (a llama-server reports no pool size the doctor can read). Defers to kv-pool-too-small
    when the failures bound the pool below a few requests of the context (kv_bound.py): that is the cause."""
    records = [r for run in ctx.inputs.runs for r in run.records]
    refused = [phrase for r in records if not r.ok and (phrase := kv_full_phrase(r.error))]
    if not refused:
        return None
    share = len(refused) / len(records)
    bounded = estimated_pool_too_small(ctx)  # the pool holds too few requests of the context: the cause
    return Finding(
        rule_id="kv-cache-pressure", title="The KV cache is full: the server fails requests", severity=Severity.HIGH,
        confidence=0.95, impact=clamp01(max(share, 0.5)),
        impact_basis="the share of requests the server failed for want of KV space",
        summary=(f"{len(refused)} of {len(records)} requests failed with \"{refused[0]}\": the server's KV "
                 "buffer had no room for the tokens in flight, and it fails a request rather than queue or preempt "
                 "it (llama-server's unified KV buffer: --ctx-size, shared by its --parallel slots)."),
        evidence=(Evidence("requests failed for a full KV cache", len(refused), "", "client"),
                  Evidence("share of requests sent", share, "%", "client")),
        defers_to=bounded.rule_id if bounded is not None else "",
        fixes=(Fix("give the KV buffer room for every slot's context (llama-server: --ctx-size = --parallel x the "
                   "context a request needs)", kvpilot="--kv-cache-memory <2x current>",
                   vllm="--gpu-memory-utilization 0.95 (or --kv-cache-memory-bytes)"),
               Fix("or run fewer requests at once", kvpilot="--max-num-seqs <lower>", vllm="--max-num-seqs <lower>"),
               Fix("or store KV in fewer bits", kvpilot="--kv-cache-dtype fp8", vllm="--kv-cache-dtype fp8")))


def kv_pressure(ctx: RuleContext) -> Finding | None:
    """KV usage near 100% and/or preemptions (recomputed prefills), often with requests waiting; or a pool full
    enough (``kv_usage_warn``) that it evicted the traffic's cached prefixes before reuse, where it is the cause of
    ``prefix-cache-miss`` and takes that finding's severity (prefix_reuse.py). Requests failed for a full KV
    buffer come first (kv_full_refusals)."""
    refused = kv_full_refusals(ctx)
    if refused is not None:
        return refused
    th, view = ctx.th, ctx.view
    usage, preempt = view.kv_usage_max, view.num_preemptions or 0.0
    full = usage is not None and usage >= th.kv_usage_high
    reuse = prefix_shortfall(ctx)
    evicted = evicted_by_full_pool(ctx, reuse)
    if not full and preempt <= 0 and not evicted:
        return _filling_up(ctx) if usage is not None and usage >= th.kv_usage_warn else None
    num_finished = len(ctx.inputs.ok_records) or (ctx.inputs.metrics.get("num_finished")
                                                   if ctx.inputs.metrics else None) or 0
    per_request = preempt / num_finished if num_finished else (1.0 if preempt else 0.0)
    waiting = (view.waiting_mean or 0.0) >= th.min_waiting_mean or (view.waiting_max or 0.0) >= 1
    # High when requests are actually held back: a full pool with a queue, or frequent preemptions
    # while the pool is full or requests wait (a few lifetime preemptions alone are a warning).
    often = per_request >= th.preemptions_per_request_high
    severity = Severity.HIGH if (full or waiting) and (often or (full and waiting)) else Severity.MEDIUM
    if evicted and reuse is not None and prefix_severity(reuse).rank > severity.rank:
        severity = prefix_severity(reuse)
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
    evidence += evicted
    signals = sum([full, preempt > 0, waiting, bool(evicted)])
    what = " and ".join(p for p in (f"KV cache {usage:.0%} full" if usage is not None else "",
                                    f"{preempt:.0f} preemptions" if preempt else "") if p)
    held = pool_explains_pressure(ctx)
    if held is not None:  # the configuration is the cause: kv-pool-too-small leads, with the exact fix
        what += f" (the pool holds only {held:.1f} requests of max_model_len: see kv-pool-too-small)"
    return Finding(
        rule_id="kv-cache-pressure", title="KV cache is too small for the traffic",
        severity=severity, confidence=min(0.95, 0.5 + 0.2 * signals) if held is None else 0.4,
        impact=clamp01(max(queue_share or 0.0, min(1.0, per_request), 0.4, reuse.lost if evicted and reuse else 0.0)),
        summary=(f"{what}: " + ("new requests cannot get blocks, so they wait" if waiting else
                                "the pool is close to its limit")
                 + (", and running requests are preempted and recomputed" if preempt else "") + "."
                 + (_eviction_summary(reuse) if evicted and reuse is not None else "")),
        evidence=tuple(evidence),
        fixes=_pressure_fixes(ctx, full or preempt > 0, bool(evicted)) + (
               Fix("store KV in fewer bits: fp8 halves a 16-bit cache, bfloat16 halves a float32 one",
                   kvpilot="--kv-cache-dtype fp8 (bfloat16 for a float32 model)", vllm="--kv-cache-dtype fp8"),
               Fix("cap the context length so fewer blocks are reserved per request",
                   kvpilot="--max-model-len <longest real request>", vllm="--max-model-len <longest real request>"),
               Fix("run fewer sequences at once: fewer preemptions", kvpilot="--max-num-seqs <lower>",
                   vllm="--max-num-seqs <lower>"),
               Fix("add memory: more GPUs (tensor parallel) or a larger GPU", vllm="--tensor-parallel-size 2")),
        defers_to="kv-pool-too-small" if held is not None else "")


def _more_memory(ctx: RuleContext) -> Fix:
    """Twice the KV memory the server reports (kvpilot's capacity endpoint), so --verify can apply it; a
    placeholder where the current size is not known."""
    cfg = ctx.inputs.server_config
    current = cfg.kv_cache_memory_bytes if cfg is not None else None
    return Fix("give the KV cache more memory",
               kvpilot=f"--kv-cache-memory {math.ceil(2 * current / MIB)}MiB" if current else
               "--kv-cache-memory <2x current>",
               vllm="--gpu-memory-utilization 0.95 (or --kv-cache-memory-bytes)")


def _pressure_fixes(ctx: RuleContext, full: bool, evicted: bool) -> tuple[Fix, ...]:
    """A pool that filled (or preempted) needs room first; one that only evicted cached prefixes it still had room
    around can keep them in a slower tier instead (KV offload), which adds a copy back to every reuse."""
    room = _more_memory(ctx)
    if not evicted:
        return (room,)
    return (room, OFFLOAD_FIX) if full else (OFFLOAD_FIX, room)


def _eviction_summary(reuse: PrefixReuse) -> str:
    offer = f"{reuse.expected:.0%} could" if reuse.expected is not None else "prefixes repeat"
    return (f" It evicted the traffic's cached prompt prefixes before their group came back: {reuse.hit or 0.0:.0%} "
            f"of prompt tokens hit the prefix cache where {offer}, so prefixes were recomputed (prefix-cache-miss "
            "is this pool's symptom).")


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


def shared_prefix_traffic(ctx: RuleContext) -> bool:
    """Whether the measured traffic repeated prompt prefixes (a shared-prefix run or prefix groups)."""
    return shared_groups(ctx) > 0 or any(expected_hit_rate(run) is not None for run in ctx.inputs.runs)


def prefix_cache_miss(ctx: RuleContext) -> Finding | None:
    """Traffic shares prefixes but the server's prefix-cache hit rate is low (or caching is off). When the
    requests of a prefix group went to several replicas (``prefix-blind-routing``), that is the cause: this
    finding then says so, with confidence 0.4, and ranks below it."""
    reuse = prefix_shortfall(ctx)
    if reuse is None:
        return None
    view, expected, shared, hit, disabled = ctx.view, reuse.expected, reuse.num_groups, reuse.hit, reuse.disabled
    evidence = [Evidence("prefix groups with repeated prefixes", shared, "", "request group ids")]
    if expected is not None:
        evidence.append(Evidence("achievable hit rate (shared-prefix dataset)", expected, "%"))
    if hit is not None:
        evidence.append(Evidence("measured prefix-cache hit rate", hit, "%", view.source))
    if disabled:
        evidence.append(Evidence("enable_prefix_caching", 0.0, "", view.config_source))
    routing = None if disabled else measure_routing(ctx)
    blind = routing is not None and routing.blind
    full_pool = not blind and bool(evicted_by_full_pool(ctx, reuse))
    return Finding(
        rule_id="prefix-cache-miss", title="Shared prompt prefixes are recomputed instead of reused",
        severity=prefix_severity(reuse),
        confidence=0.4 if blind or full_pool else 0.9 if disabled or expected is not None else 0.6,
        impact=clamp01(reuse.lost),
        summary=("The traffic repeats prompt prefixes ("
                 + (f"up to {expected:.0%} of prompt tokens reusable" if expected is not None
                    else f"{shared} groups of requests share one") + ") but "
                 + ("prefix caching is disabled." if disabled or hit is None else
                    f"only {hit:.0%} hit the cache: their prefill is recomputed every time.")
                 + (" Requests of one prefix group went to several replicas: see prefix-blind-routing."
                    if blind else "")
                 + (" The KV pool was full: it evicted the cached prefixes before their group came back (see "
                    "kv-cache-pressure)." if full_pool else "")),
        evidence=tuple(evidence),
        fixes=(Fix("turn prefix caching on", kvpilot="--enable-prefix-caching", vllm="--enable-prefix-caching"),
               Fix("keep the shared part first and byte-identical (no timestamps or ids before it)"),
               Fix("keep cached prefixes from being evicted: more KV memory",
                   kvpilot="--kv-cache-memory <larger>", vllm="--gpu-memory-utilization 0.95"),
               Fix("route requests with the same prefix to the same replica (prefix-aware routing)")),
        defers_to="prefix-blind-routing" if blind else "kv-cache-pressure" if full_pool else "")


def prefix_severity(reuse: PrefixReuse) -> Severity:
    """High when caching is off or the cache gave under a fifth of the reuse on offer."""
    return Severity.HIGH if reuse.disabled or (reuse.hit or 0.0) < 0.2 * reuse.bar else Severity.MEDIUM
