"""Rules on KV memory: KV-cache pressure and prefix-cache misses (swap and host memory: spillover.py)."""

from __future__ import annotations

import math

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.routing import measure_routing
from kvpilot.doctor.signals import first_token_s, ratio


def pool_explains_pressure(ctx: RuleContext) -> float | None:
    """Requests of max_model_len the pool holds, when so few (< ``max_len_requests_high``) that the
    pool's size is the cause of any measured KV pressure; else None."""
    cfg = ctx.inputs.server_config
    held = cfg.max_len_requests if cfg is not None else None
    return held if held is not None and held < ctx.th.max_len_requests_high else None


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
    held = pool_explains_pressure(ctx)
    if held is not None:  # the configuration is the cause: kv-pool-too-small leads, with the exact fix
        what += f" (the pool holds only {held:.1f} requests of max_model_len: see kv-pool-too-small)"
    return Finding(
        rule_id="kv-cache-pressure", title="KV cache is too small for the traffic",
        severity=severity, confidence=min(0.95, 0.5 + 0.2 * signals) if held is None else 0.4,
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
               Fix("add memory: more GPUs (tensor parallel) or a larger GPU", vllm="--tensor-parallel-size 2")),
        defers_to="kv-pool-too-small" if held is not None else "")


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


def shared_prefix_traffic(ctx: RuleContext) -> bool:
    """Whether the measured traffic repeated prompt prefixes (a shared-prefix run or prefix groups)."""
    return _shared_groups(ctx) > 0 or any(_expected_hit_rate(run) is not None for run in ctx.inputs.runs)


def prefix_cache_miss(ctx: RuleContext) -> Finding | None:
    """Traffic shares prefixes but the server's prefix-cache hit rate is low (or caching is off). When the
    requests of a prefix group went to several replicas (``prefix-blind-routing``), that is the cause: this
    finding then says so, with confidence 0.4, and ranks below it."""
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
        evidence.append(Evidence("enable_prefix_caching", 0.0, "", view.config_source))
    lost = (expected or bar) - (hit or 0.0)
    routing = None if disabled else measure_routing(ctx)
    blind = routing is not None and routing.blind
    return Finding(
        rule_id="prefix-cache-miss", title="Shared prompt prefixes are recomputed instead of reused",
        severity=Severity.HIGH if disabled or (hit or 0.0) < 0.2 * bar else Severity.MEDIUM,
        confidence=0.4 if blind else 0.9 if disabled or expected is not None else 0.6, impact=clamp01(lost),
        summary=("The traffic repeats prompt prefixes ("
                 + (f"up to {expected:.0%} of prompt tokens reusable" if expected is not None
                    else f"{shared} groups of requests share one") + ") but "
                 + ("prefix caching is disabled." if disabled or hit is None else
                    f"only {hit:.0%} hit the cache: their prefill is recomputed every time.")
                 + (" Requests of one prefix group went to several replicas: see prefix-blind-routing."
                    if blind else "")),
        evidence=tuple(evidence),
        fixes=(Fix("turn prefix caching on", kvpilot="--enable-prefix-caching", vllm="--enable-prefix-caching"),
               Fix("keep the shared part first and byte-identical (no timestamps or ids before it)"),
               Fix("keep cached prefixes from being evicted: more KV memory",
                   kvpilot="--kv-cache-memory <larger>", vllm="--gpu-memory-utilization 0.95"),
               Fix("route requests with the same prefix to the same replica (prefix-aware routing)")),
        defers_to="prefix-blind-routing" if blind else "")
