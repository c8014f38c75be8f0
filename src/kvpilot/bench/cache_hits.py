"""Prefix-cache and KV-offload-tier hits of a run, first turns apart from returning ones (multi-turn sessions).

A returning turn resends its session's whole history, so its prompt starts with what the server computed for
the previous turn: a prefix cache serves it, or a KV offload tier copies it back once the pool evicted it, or it
is recomputed. Per request the server says which (kvpilot's ``cached_tokens`` / ``tier_cached_tokens``; the
OpenAI usage's ``prompt_tokens_details.cached_tokens`` from vLLM and kvpilot), and over the run its counters do
(``vllm:prefix_cache_hits``, ``vllm:external_prefix_cache_hits``), so this works against vLLM too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvpilot.bench.records import RequestRecord
from kvpilot.bench.scrape import MetricsSummary


def cached_tokens(r: RequestRecord) -> int | None:
    """Prompt tokens the server did not compute for ``r``: its timings field, else the usage; None: not told."""
    if r.server is not None:
        return r.server.num_cached_tokens
    return r.num_usage_cached_tokens


@dataclass(frozen=True)
class TurnHits:
    """Requests of one kind (first or returning turns) that reported their cached tokens, and their tokens.
    Invariant: num_tier_cached_tokens <= num_cached_tokens <= num_prompt_tokens."""

    num_requests: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_tier_cached_tokens: int

    @property
    def hit_rate(self) -> float | None:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else None

    @staticmethod
    def of(records: list[RequestRecord]) -> TurnHits:
        told = [(r, c) for r in records if r.ok and (c := cached_tokens(r)) is not None and r.num_prompt_tokens]
        return TurnHits(len(told), sum(r.num_prompt_tokens or 0 for r, _ in told), sum(c for _, c in told),
                        sum(r.server.num_tier_cached_tokens for r, _ in told if r.server is not None))


@dataclass(frozen=True)
class CacheHits:
    """A run's hits: ``first`` turns (turn_index 0) and ``returning`` ones, from the responses; the server's own
    counters over the run when it exports them (``server_*``, tokens)."""

    first: TurnHits
    returning: TurnHits
    server_prefix_hits: float | None
    server_tier_hits: float | None
    server_tier_queries: float | None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = asdict(self)
        out["first"]["hit_rate"], out["returning"]["hit_rate"] = self.first.hit_rate, self.returning.hit_rate
        return out

    def lines(self) -> list[str]:
        """What the console prints: one line per kind of turn, then the server's counters."""
        out = []
        for name, t in (("first turns", self.first), ("returning turns", self.returning)):
            if t.num_requests:
                out.append(f"{name}: {t.num_requests} requests, {t.num_cached_tokens:,} of {t.num_prompt_tokens:,} "
                           f"prompt tokens cached ({t.hit_rate or 0.0:.0%}), {t.num_tier_cached_tokens:,} of them "
                           "from the KV offload tier")
        if self.server_prefix_hits is not None or self.server_tier_hits is not None:
            tier = "not exported (no offload tier)" if self.server_tier_hits is None else f"{self.server_tier_hits:,.0f}"
            pool = "n/a" if self.server_prefix_hits is None else f"{self.server_prefix_hits:,.0f}"
            out.append(f"server: prefix-cache hits {pool} tokens, offload-tier hits {tier}")
        return out


def cache_hits(records: list[RequestRecord], summary: MetricsSummary | None) -> CacheHits | None:
    """None when no response reported cached tokens and the server exported no prefix counter."""
    first = TurnHits.of([r for r in records if r.turn_index == 0])
    returning = TurnHits.of([r for r in records if r.turn_index > 0])
    pool = summary.prefix_cache_hits if summary is not None else None
    tier = summary.external_prefix_cache_hits if summary is not None else None
    queries = summary.external_prefix_cache_queries if summary is not None else None
    if not first.num_requests and not returning.num_requests and pool is None:
        return None
    return CacheHits(first, returning, pool, tier, queries)
