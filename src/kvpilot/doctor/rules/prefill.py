"""Rules on prefill: TTFT growing with prompt length, long prompts blocking short ones, and long
prefills stalling other requests' decoding."""

from __future__ import annotations

from kvpilot.bench.records import RequestRecord
from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.spillover import defer_to_swap
from kvpilot.doctor.signals import (
    gap_ends,
    is_long,
    median,
    median_prompt_len,
    overlaps_prefill,
    pearson,
    quantile,
    ratio,
    slope,
)

CHUNK_FIX = Fix("bound the prefill work per step so other requests are scheduled between chunks",
                kvpilot="--max-num-batched-tokens 512",
                vllm="--max-num-batched-tokens 512 --long-prefill-token-threshold 256 --max-num-partial-prefills 2")
LANES_FIX = Fix("serve long and short prompts in separate lanes (replicas), or give interactive "
                "requests priority", kvpilot="--scheduling-policy priority", vllm="--scheduling-policy priority")


def _prefill_ms(r: RequestRecord) -> float | None:
    """Server prefill time when kvpilot reported it (queue excluded), else the client's TTFT."""
    return r.server.prefill_ms if r.server is not None else r.ttft_ms


def prefill_bound(ctx: RuleContext) -> Finding | None:
    """TTFT grows with prompt length (strong correlation, length explains most of p90 TTFT) and is
    high: prefill compute is the bottleneck."""
    th = ctx.th
    rows = [(float(r.num_prompt_tokens), p, r.ttft_ms) for r in ctx.inputs.ok_records
            if r.num_prompt_tokens and (p := _prefill_ms(r)) is not None and r.ttft_ms is not None]
    if len(rows) < th.min_requests:
        return None
    xs, ys = [x for x, _, _ in rows], [y for _, y, _ in rows]
    lo, hi = quantile(xs, 0.1) or 0.0, quantile(xs, 0.9) or 0.0
    corr, per_token = pearson(xs, ys), slope(xs, ys)
    ttft_p90 = quantile([t for _, _, t in rows], 0.9) or 0.0
    slos = [float(run.slos_ms["ttft"]) for run in ctx.inputs.runs if run.slos_ms.get("ttft")]
    limit = min(slos, default=th.ttft_high_ms)  # the tightest TTFT SLO given to bench, if any
    if lo <= 0 or hi / lo < th.min_length_spread or corr is None or per_token is None:
        return None
    explained = per_token * (hi - lo) / ttft_p90 if ttft_p90 > 0 else 0.0
    if corr < th.prefill_min_correlation or explained < th.prefill_length_share or ttft_p90 < limit:
        return None
    evidence = [Evidence("prefill time per 1k prompt tokens", per_token * 1000, "ms"),
                Evidence("correlation of prompt length and prefill time", corr),
                Evidence("p90 TTFT", ttft_p90, "ms", "client"), Evidence("TTFT limit", limit, "ms"),
                Evidence("share of p90 TTFT explained by prompt length", clamp01(explained), "%")]
    roof = ctx.inputs.roofline
    if roof is not None:
        evidence.append(Evidence(f"roofline TTFT for the median prompt ({roof.gpu})", roof.ttft_ms, "ms"))
    return defer_to_swap(ctx, Finding(
        rule_id="prefill-bound", title="Prefill is slow: TTFT grows with prompt length",
        severity=Severity.HIGH if ttft_p90 >= 2 * limit else Severity.MEDIUM,
        confidence=clamp01(0.6 + (corr - th.prefill_min_correlation)), impact=clamp01(explained),
        summary=(f"Each 1k prompt tokens add {per_token * 1000:.0f} ms before the first token "
                 f"(correlation {corr:.2f}); p90 TTFT is {ttft_p90:.0f} ms."),
        evidence=tuple(evidence),
        fixes=(Fix("reuse shared prompt prefixes instead of recomputing them",
                   kvpilot="--enable-prefix-caching", vllm="--enable-prefix-caching"),
               Fix("prefill in fewer, larger steps when latency of others allows",
                   kvpilot="--max-num-batched-tokens 8192", vllm="--max-num-batched-tokens 8192"),
               Fix("use a faster attention kernel", vllm="VLLM_ATTENTION_BACKEND=FLASH_ATTN"),
               Fix("split prefill over more GPUs or shorten prompts", vllm="--tensor-parallel-size 2"))))


def _longs_and_median(records: list[RequestRecord], factor: float) -> tuple[list[RequestRecord], float]:
    med = median_prompt_len(records)
    return [r for r in records if is_long(r, med, factor)], med


def long_short_mixing(ctx: RuleContext) -> Finding | None:
    """Short requests' TTFT is inflated while a long prompt is in prefill (head-of-line blocking)."""
    th = ctx.th
    best: tuple[float, float, float, int, int, str] | None = None
    for run in ctx.inputs.runs:
        ok = run.ok
        longs, _ = _longs_and_median(ok, th.long_prompt_ratio)
        if not longs:
            continue
        long_ids = {id(r) for r in longs}
        shorts = [r for r in ok if id(r) not in long_ids and r.ttft_ms is not None]
        hit = [r.ttft_ms for r in shorts
               if overlaps_prefill(r.sent_s, r.sent_s + (r.ttft_ms or 0) / 1000, longs, r)]
        clear = [r.ttft_ms for r in shorts
                 if not overlaps_prefill(r.sent_s, r.sent_s + (r.ttft_ms or 0) / 1000, longs, r)]
        if len(hit) < th.min_group_size or len(clear) < th.min_group_size:
            continue
        inflation = ratio(median(hit), median(clear))
        if inflation is not None and (best is None or inflation > best[0]):
            best = (inflation, median(hit) or 0.0, median(clear) or 0.0, len(hit), len(shorts), run.label)
    if best is None or best[0] < th.short_ttft_inflation:
        return None
    inflation, hit_ms, clear_ms, num_hit, num_short, label = best
    affected = num_hit / num_short
    return defer_to_swap(ctx, Finding(
        rule_id="long-short-mixing", title="Long prompts delay short requests' first token",
        severity=Severity.HIGH if inflation >= 2 * th.short_ttft_inflation else Severity.MEDIUM,
        confidence=0.85, impact=clamp01(affected * (1 - 1 / inflation)),
        summary=(f"Short requests that arrive while a long prompt is being prefilled wait {hit_ms:.0f} ms "
                 f"for their first token, {inflation:.1f}x the {clear_ms:.0f} ms of the others "
                 f"({num_hit} of {num_short} short requests in run '{label}')."),
        evidence=(Evidence("short TTFT during a long prefill (median)", hit_ms, "ms", "client"),
                  Evidence("short TTFT otherwise (median)", clear_ms, "ms", "client"),
                  Evidence("inflation", inflation, "x"), Evidence("short requests affected", affected, "%")),
        fixes=(CHUNK_FIX, LANES_FIX)))


Stall = tuple[RequestRecord, float, float]  # request, when the gap ended (run clock, s), gap ms


def _stalls(records: list[RequestRecord], th_ratio: float, min_ms: float) -> tuple[list[Stall], float | None]:
    """Gaps at least ``th_ratio`` x the median gap (and >= ``min_ms``): (request, end time, gap)."""
    med = median(g for r in records for g in r.itl_ms)
    if med is None:
        return [], None
    bar = max(th_ratio * med, min_ms)
    return [(r, t, g) for r in records for t, g in gap_ends(r) if g >= bar], med


def prefill_interrupts_decode(ctx: RuleContext) -> Finding | None:
    """Inter-token stalls that coincide with other requests' long prefills: batching hurts interactivity."""
    th = ctx.th
    best: tuple[float, int, float, float, float, str] | None = None
    for run in ctx.inputs.runs:
        ok = run.ok
        longs, _ = _longs_and_median(ok, th.long_prompt_ratio)
        stalls, med = _stalls(ok, th.itl_spike_ratio, th.min_itl_spike_ms)
        if not longs or med is None or len(stalls) < th.min_num_spikes:
            continue
        during = [g for r, t, g in stalls if overlaps_prefill(t - g / 1000, t, longs, r)]
        share = len(during) / len(stalls)
        affected = len({id(r) for r, _, _ in stalls}) / len(ok)
        if best is None or share > best[0]:
            best = (share, len(stalls), med, median(during) or 0.0, affected, run.label)
    if best is None or best[0] < th.spike_overlap_share:
        return None
    share, num, med, stall_ms, affected, label = best
    return defer_to_swap(ctx, Finding(
        rule_id="prefill-interrupts-decode", title="Long prefills stall other requests' token stream",
        severity=Severity.HIGH if stall_ms >= 10 * med else Severity.MEDIUM,
        confidence=clamp01(0.5 + 0.4 * share), impact=clamp01(affected),
        summary=(f"{num} inter-token stalls (median {stall_ms:.0f} ms vs a normal gap of {med:.0f} ms); "
                 f"{share:.0%} of them happen while another request's long prompt is prefilled "
                 f"(run '{label}'): its prefill shares steps with their decoding."),
        evidence=(Evidence("stalls", num), Evidence("median stall during a long prefill", stall_ms, "ms", "client"),
                  Evidence("median inter-token gap", med, "ms", "client"),
                  Evidence("stalls during a long prefill", share, "%"),
                  Evidence("requests with a stall", affected, "%")),
        fixes=(CHUNK_FIX, LANES_FIX)))
