"""Rules on prefill: TTFT growing with prompt length, long prompts blocking short ones, and long
prefills stalling other requests' decoding."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.bench.records import RequestRecord
from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.deferral import defer_to_host
from kvpilot.doctor.rules.foreign_prefill import CHUNK_TOKENS, long_prompts_stall_decodes
from kvpilot.doctor.thresholds import Thresholds
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
                kvpilot=f"--max-num-batched-tokens {CHUNK_TOKENS}",
                vllm="--max-num-batched-tokens 512 --long-prefill-token-threshold 256 --max-num-partial-prefills 2")
LANES_FIX = Fix("serve long and short prompts in separate lanes (replica pools with their own token budgets, "
                "routed by prompt length or an X-Lane header), or give interactive requests priority in one engine",
                kvpilot="kvpilot serve --ray --ray-config lanes.yaml (docs/ray.md: an interactive lane with "
                        "max_prompt_chars and a small --max-num-batched-tokens, a long lane with a large one); "
                        "or --scheduling-policy priority",
                vllm="--scheduling-policy priority")


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
    slos = [ctx.slos["ttft"]] if ctx.slos.get("ttft") else []
    limit = min(slos, default=th.ttft_high_ms)  # the TTFT SLO (--slo, --workload or bench's), if any
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
    summary = (f"Each 1k prompt tokens add {per_token * 1000:.0f} ms before the first token "
               f"(correlation {corr:.2f}); p90 TTFT is {ttft_p90:.0f} ms.")
    severity = Severity.HIGH if ttft_p90 >= 2 * limit else Severity.MEDIUM
    if not slos and _no_setting_shortens_prefill(ctx, max(xs)):
        # The issue-13 rule: a fix must be able to change what was measured. With no TTFT target given, the
        # hardware's own prefill speed is a note, not a problem with the deployment.
        severity = Severity.LOW
        summary += (" Every prompt was prefilled in one step with prefix caching on: no server setting "
                    "shortens this, it is this hardware's prefill speed (pass a TTFT SLO to judge it).")
    return defer_to_host(ctx, Finding(
        rule_id="prefill-bound", title="Prefill is slow: TTFT grows with prompt length",
        severity=severity, confidence=clamp01(0.6 + (corr - th.prefill_min_correlation)),
        impact=clamp01(explained), summary=summary, evidence=tuple(evidence),
        fixes=(Fix("reuse shared prompt prefixes instead of recomputing them",
                   kvpilot="--enable-prefix-caching", vllm="--enable-prefix-caching"),
               Fix("prefill in fewer, larger steps when latency of others allows",
                   kvpilot="--max-num-batched-tokens 8192", vllm="--max-num-batched-tokens 8192"),
               Fix("use a faster attention kernel", vllm="VLLM_ATTENTION_BACKEND=FLASH_ATTN"),
               Fix("split prefill over more GPUs or shorten prompts", vllm="--tensor-parallel-size 2"))))


def _no_setting_shortens_prefill(ctx: RuleContext, longest_prompt: float) -> bool:
    """The server says prefix caching is on and its token budget holds the longest prompt whole (one step):
    the configuration fixes above cannot help. Unknown configuration (another server): False."""
    cfg = ctx.inputs.server_config
    return (cfg is not None and cfg.enable_prefix_caching is True and cfg.max_num_batched_tokens is not None
            and longest_prompt <= cfg.max_num_batched_tokens)


def _longs_and_median(records: list[RequestRecord], factor: float) -> tuple[list[RequestRecord], float]:
    med = median_prompt_len(records)
    return [r for r in records if is_long(r, med, factor)], med


@dataclass(frozen=True)
class Mixing:
    """Short requests' TTFT during vs outside a long prefill, in the run where it is worst."""

    inflation: float
    hit_ms: float
    clear_ms: float
    num_hit: int
    num_short: int
    label: str
    long_len: float
    long_prefill_ms: float | None

    def inherent(self, th: Thresholds) -> bool:
        """The delay is the one step the long prompt is computed in, and chunking cannot split that
        prompt (it is no longer than the chunk the fix proposes): hardware speed, not configuration."""
        one_step = self.long_prefill_ms is not None and \
            self.hit_ms - self.clear_ms <= th.single_step_delay_steps * self.long_prefill_ms
        return one_step and self.long_len <= CHUNK_TOKENS


def _long_prefill_ms(longs: list[RequestRecord]) -> float | None:
    """Median prefill time of the long prompts (server timing, else their TTFT)."""
    return median(_prefill_ms(r) for r in longs)


def measure_mixing(ctx: RuleContext) -> Mixing | None:
    """The run where short requests' TTFT is most inflated by overlapping long prefills."""
    th = ctx.th
    best: Mixing | None = None
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
        if inflation is not None and (best is None or inflation > best.inflation):
            best = Mixing(inflation, median(hit) or 0.0, median(clear) or 0.0, len(hit), len(shorts), run.label,
                          median(float(r.num_prompt_tokens or 0) for r in longs) or 0.0, _long_prefill_ms(longs))
    return best


def mixing_note(ctx: RuleContext) -> str | None:
    """Headroom note for the inherent case (see :meth:`Mixing.inherent`)."""
    m = measure_mixing(ctx)
    if m is None or m.inflation < ctx.th.short_ttft_inflation or not m.inherent(ctx.th):
        return None
    return (f"a {m.long_len:.0f}-token prompt is prefilled in one step of ~{m.long_prefill_ms:.0f} ms here; short "
            f"requests arriving during it waited {m.hit_ms - m.clear_ms:.0f} ms more ({m.inflation:.1f}x, run "
            f"'{m.label}'): one step of this hardware, which chunking cannot shorten (the prompt fits one "
            f"{CHUNK_TOKENS}-token chunk)")


def long_short_mixing(ctx: RuleContext) -> Finding | None:
    """Short requests' TTFT is inflated while a long prompt is in prefill (head-of-line blocking).
    Not a finding when the delay is inherent (one unsplittable step): :func:`mixing_note` says so."""
    th = ctx.th
    m = measure_mixing(ctx)
    if m is None or m.inflation < th.short_ttft_inflation or m.inherent(th):
        return None
    affected = m.num_hit / m.num_short
    evidence = [Evidence("short TTFT during a long prefill (median)", m.hit_ms, "ms", "client"),
                Evidence("short TTFT otherwise (median)", m.clear_ms, "ms", "client"),
                Evidence("inflation", m.inflation, "x"), Evidence("short requests affected", affected, "%"),
                Evidence("long prompt (median)", m.long_len, "tokens", "server usage")]
    if m.long_prefill_ms is not None:
        evidence.append(Evidence("long prompt prefill (median)", m.long_prefill_ms, "ms"))
    return defer_to_host(ctx, Finding(
        rule_id="long-short-mixing", title="Long prompts delay short requests' first token",
        severity=Severity.HIGH if m.inflation >= 2 * th.short_ttft_inflation else Severity.MEDIUM,
        confidence=0.85, impact=clamp01(affected * (1 - 1 / m.inflation)),
        summary=(f"Short requests that arrive while a long prompt is being prefilled wait {m.hit_ms:.0f} ms "
                 f"for their first token, {m.inflation:.1f}x the {m.clear_ms:.0f} ms of the others "
                 f"({m.num_hit} of {m.num_short} short requests in run '{m.label}')."),
        evidence=tuple(evidence), fixes=(CHUNK_FIX, LANES_FIX)))


Stall = tuple[RequestRecord, float, float]  # request, when the gap ended (run clock, s), gap ms


def _stalls(records: list[RequestRecord], th_ratio: float, min_ms: float) -> tuple[list[Stall], float | None]:
    """Gaps at least ``th_ratio`` x the median gap (and >= ``min_ms``): (request, end time, gap)."""
    med = median(g for r in records for g in r.itl_ms)
    if med is None:
        return [], None
    bar = max(th_ratio * med, min_ms)
    return [(r, t, g) for r in records for t, g in gap_ends(r) if g >= bar], med


@dataclass(frozen=True)
class Stalls:
    """Inter-token stalls and how many fall in another request's long prefill (the worst run)."""

    share: float
    num: int
    normal_ms: float
    stall_ms: float
    affected: float
    label: str
    long_len: float
    long_prefill_ms: float | None

    def inherent(self, th: Thresholds) -> bool:
        """Each stall is the one step a long prompt that fits one chunk was computed in."""
        return self.long_prefill_ms is not None and self.long_len <= CHUNK_TOKENS and \
            self.stall_ms <= th.single_step_delay_steps * self.long_prefill_ms + self.normal_ms


def measure_stalls(ctx: RuleContext) -> Stalls | None:
    th = ctx.th
    best: Stalls | None = None
    for run in ctx.inputs.runs:
        ok = run.ok
        longs, _ = _longs_and_median(ok, th.long_prompt_ratio)
        stalls, med = _stalls(ok, th.itl_spike_ratio, th.min_itl_spike_ms)
        if not longs or med is None or len(stalls) < th.min_num_spikes:
            continue
        during = [g for r, t, g in stalls if overlaps_prefill(t - g / 1000, t, longs, r)]
        share = len(during) / len(stalls)
        if best is None or share > best.share:
            best = Stalls(share, len(stalls), med, median(during) or 0.0, len({id(r) for r, _, _ in stalls}) / len(ok),
                          run.label, median(float(r.num_prompt_tokens or 0) for r in longs) or 0.0,
                          _long_prefill_ms(longs))
    return best


def stall_note(ctx: RuleContext) -> str | None:
    """Headroom note for the inherent case (see :meth:`Stalls.inherent`)."""
    s = measure_stalls(ctx)
    if s is None or s.share < ctx.th.spike_overlap_share or not s.inherent(ctx.th):
        return None
    return (f"token streams paused {s.stall_ms:.0f} ms (normal gap {s.normal_ms:.0f} ms) while a "
            f"{s.long_len:.0f}-token prompt was prefilled in one step (run '{s.label}'): one step of this "
            f"hardware, which chunking cannot shorten (the prompt fits one {CHUNK_TOKENS}-token chunk)")


def prefill_interrupts_decode(ctx: RuleContext) -> Finding | None:
    """Inter-token stalls that coincide with other requests' long prefills: batching hurts interactivity.
    Not a finding when each stall is one unsplittable step: :func:`stall_note` says so. Long prompts of
    clients the doctor did not measure are seen in the server's metrics instead (foreign_prefill.py)."""
    th = ctx.th
    s = measure_stalls(ctx)
    if s is None or s.share < th.spike_overlap_share or s.inherent(th):
        foreign = long_prompts_stall_decodes(ctx)
        return defer_to_host(ctx, foreign) if foreign is not None else None
    share, num, med, stall_ms, affected, label = s.share, s.num, s.normal_ms, s.stall_ms, s.affected, s.label
    return defer_to_host(ctx, Finding(
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
