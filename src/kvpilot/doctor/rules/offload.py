"""Returning turns' prefixes recomputed because the pool evicted them, with no KV offload tier to keep them.

A multi-turn session resends its whole history each turn. The part the server computed on the previous turn
(that turn's prompt and answer) is the prefix the next turn could reuse; what the response says was cached
(bench's ``cached_tokens``: kvpilot's field or the OpenAI usage) short of it was recomputed. With prefix caching
on and no offload tier, that happens when the pool evicted the session between its turns (a pool full or
busy enough: usage at ``kv_usage_warn`` or preemptions, or the sessions' histories together larger than the
pool). A host-memory tier (``--kv-offloading-size``, the same
flag in kvpilot and vLLM) keeps evicted blocks and copies them back. The time it would save is estimated from
the recomputed tokens and the prefill rate measured on the same server.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.bench.cache_hits import cached_tokens
from kvpilot.bench.records import RequestRecord
from kvpilot.doctor.findings import Evidence, Finding, Fix, LatencyShare, Severity, clamp01
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.signals import median

OFFLOAD_GIB = 2
"""The tier the fix proposes: host RAM beside the pool (GiB, as both engines' flag takes it)."""


@dataclass(frozen=True)
class Recompute:
    """Over the returning turns that reported cached tokens: their count, the prefix they could reuse, the part
    recomputed, the tier's hits, the prefill rate (ms per computed prompt token) and their mean TTFT."""

    num_turns: int
    num_reusable: int
    num_recomputed: int
    num_tier_hits: int
    ms_per_token: float
    ttft_ms: float
    history_tokens: tuple[int, ...] = ()  # each session's longest reusable prefix: what the pool had to keep

    @property
    def num_history_tokens(self) -> int:
        return sum(self.history_tokens)

    @property
    def saved_s(self) -> float:
        return self.num_recomputed * self.ms_per_token / 1000.0


def _reusable(records: list[RequestRecord]) -> list[tuple[RequestRecord, int]]:
    """(returning turn, its reusable prefix: the previous turn's prompt + answer tokens), per session."""
    by_turn = {(r.item_id, r.group_id, r.turn_index): r for r in records if r.ok}
    out = []
    for r in records:
        prev = by_turn.get((r.item_id, r.group_id, r.turn_index - 1)) if r.ok and r.turn_index > 0 else None
        if prev is not None and prev.num_prompt_tokens and r.num_prompt_tokens:
            out.append((r, min(r.num_prompt_tokens, prev.num_prompt_tokens + prev.num_output_tokens)))
    return out


def _ms_per_token(ctx: RuleContext) -> float | None:
    """Prefill ms per computed prompt token: kvpilot's timings (prefill / uncached tokens), else the server's
    prefill histogram over its prompt tokens (two scrapes)."""
    rates = [r.server.prefill_ms / n for r in ctx.inputs.ok_records if r.server is not None
             and (n := (r.num_prompt_tokens or 0) - r.server.num_cached_tokens) >= 16]
    if rates:
        return median(rates)
    snap = ctx.inputs.metrics
    prefill = snap.histograms.get("prefill") if snap is not None else None
    tokens = snap.histograms.get("request_prompt_tokens") if snap is not None else None
    return prefill.total * 1000.0 / tokens.total if prefill and tokens and tokens.total > 0 else None


def measure_recompute(ctx: RuleContext) -> Recompute | None:
    turns = [(r, n) for run in ctx.inputs.runs for r, n in _reusable(run.ok) if cached_tokens(r) is not None]
    rate = _ms_per_token(ctx)
    if len(turns) < ctx.th.min_requests or rate is None:
        return None
    reusable = sum(n for _, n in turns)
    recomputed = sum(max(0, n - (cached_tokens(r) or 0)) for r, n in turns)
    tier = sum(r.server.num_tier_cached_tokens for r, _ in turns if r.server is not None)
    longest: dict[tuple[object, object], int] = {}
    for r, n in turns:
        longest[(r.item_id, r.group_id)] = max(longest.get((r.item_id, r.group_id), 0), n)
    return Recompute(len(turns), reusable, recomputed, tier, rate, median(r.ttft_ms for r, _ in turns) or 0.0,
                     tuple(longest.values()))


def _evicting(ctx: RuleContext, m: Recompute) -> bool:
    """The pool had to evict sessions between their turns: the scrapes saw it full (or preempting), or the
    sessions' histories together outgrow it (the server's pool size; scrapes every 0.5 s miss a short run's peak).
    The pool holds whole blocks, so where the block size is known each history counts its blocks: three histories
    of 58 tokens take 12 blocks of 16, more than a pool of 11 (176 tokens) holds."""
    view, cfg = ctx.view, ctx.inputs.server_config
    if (view.kv_usage_max or 0.0) >= ctx.th.kv_usage_warn or (view.num_preemptions or 0.0) > 0:
        return True
    if cfg is None or not cfg.num_kv_tokens:
        return False
    if cfg.num_blocks and cfg.block_size:
        return sum(cfg.blocks_for(n) or 0 for n in m.history_tokens if n > 0) > cfg.num_blocks
    return m.num_history_tokens > cfg.num_kv_tokens


def _offload_configured(ctx: RuleContext) -> bool:
    """Whether the server has a tier: a response counted tier hits, or it exports the tier's counters."""
    snap = ctx.inputs.metrics
    scraped = any((run.server_metrics or {}).get("external_prefix_cache_queries") is not None
                  for run in ctx.inputs.runs)
    return scraped or (snap is not None and any(n.startswith("vllm:external_prefix") for n in snap.names.values()))


def prefix_recomputed(ctx: RuleContext) -> Finding | None:
    """Returning turns recomputed at least half the prefix they could reuse, prefix caching on, no offload tier,
    and the pool was full enough to evict (see the module docstring); high when the estimated saving is at least
    ``client_lag_share_most`` of their TTFT."""
    th, view, m = ctx.th, ctx.view, measure_recompute(ctx)
    if m is None or m.num_reusable <= 0 or m.num_recomputed < 0.5 * m.num_reusable or m.num_tier_hits:
        return None
    if view.prefix_caching_enabled is False or _offload_configured(ctx) or not _evicting(ctx, m):
        return None
    per_turn = m.num_recomputed / m.num_turns * m.ms_per_token
    share = LatencyShare(min(per_turn, m.ttft_ms), m.ttft_ms, "median TTFT of returning turns") if m.ttft_ms else None
    return Finding(
        rule_id="prefix-recomputed", title=f"Prefix recomputed: KV offload would save {m.saved_s:,.1f} s of prefill",
        severity=Severity.HIGH if share is not None and share.share >= th.client_lag_share_most else Severity.MEDIUM,
        confidence=0.75, impact=clamp01(share.share if share is not None else 0.3),
        summary=(f"{m.num_turns} returning turns could reuse {m.num_reusable:,} prompt tokens of their sessions' "
                 f"history but recomputed {m.num_recomputed:,} ({m.num_recomputed / m.num_reusable:.0%}): the pool "
                 f"(peak usage {view.kv_usage_max or 0.0:.0%}) evicted them between turns and no offload tier "
                 f"kept them. At the measured {m.ms_per_token:.2f} ms per prompt token that is {m.saved_s:,.1f} s of "
                 f"prefill (~{per_turn:,.0f} ms a turn) a KV offload tier would copy back instead."),
        evidence=(Evidence("returning turns", m.num_turns), Evidence("reusable prefix tokens", m.num_reusable),
                  Evidence("recomputed prefix tokens", m.num_recomputed, "", "responses' cached_tokens"),
                  Evidence("prefill per prompt token", m.ms_per_token, "ms"),
                  Evidence("estimated prefill saved", m.saved_s * 1000.0, "ms"),
                  Evidence("KV-cache usage, peak", view.kv_usage_max or 0.0, "%", view.source)),
        fixes=(Fix("keep the prefix blocks the pool evicts in host memory and copy them back on the next turn",
                   kvpilot=f"--kv-offloading-size {OFFLOAD_GIB}", vllm=f"--kv-offloading-size {OFFLOAD_GIB}"),
               Fix("give the KV cache more memory", kvpilot="--kv-cache-memory <2x current>",
                   vllm="--gpu-memory-utilization 0.95")),
        explains=share)
