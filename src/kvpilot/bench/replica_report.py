"""Per-replica load and prefix-cache reuse over one run, and how evenly and how prefix-aware it was spread.

Built from the run's records (which replica served each request: the ``x-kvpilot-replica`` header, or the
URL bench sent to when it routes itself) and the per-replica scrapes of :mod:`kvpilot.bench.replicas`.
Written to the result JSON as each run's ``replicas`` section (docs/bench.md) and read back by the doctor.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from kvpilot.bench.records import RequestRecord
from kvpilot.bench.replicas import ReplicaPlan, ReplicaSample, replica_id

PREFIX_GROUP_PREFIXES = ("prefix-", "session-")
"""Group ids whose requests share a prompt prefix: bench's shared-prefix groups and multi-turn sessions."""

# Where a replica's request count came from (ReplicaStats.requests_source).
SOURCE_HEADER = "x-kvpilot-replica"
SOURCE_ROUTED = "client round-robin"
SOURCE_COUNTER = "vllm:request_success_total"


@dataclass(frozen=True)
class ReplicaStats:
    """One replica over one run.

    Counters are deltas over the scrapes that reached the replica (last - first, a series not yet there
    counting 0; None when it was scraped fewer than twice or never had the series); ``prefix_hits`` and
    ``prefix_queries`` are tokens, as vLLM counts them, so ``0 <= prefix_hits <= prefix_queries``. Gauges are
    the mean and max over the during-run scrapes.
    ``num_requests``: successful requests it served, from ``requests_source`` (the response header, the URL
    bench routed to, or the server's ``vllm:request_success_total`` delta); None when nothing says.
    """

    replica: str
    lane: str | None
    num_requests: int | None
    requests_source: str | None
    prompt_tokens: float | None
    prefix_hits: float | None
    prefix_queries: float | None
    running_mean: float | None
    running_max: float | None
    waiting_mean: float | None
    waiting_max: float | None

    @property
    def prefix_hit_rate(self) -> float | None:
        q, h = self.prefix_queries, self.prefix_hits
        return h / q if q and h is not None else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "prefix_hit_rate": self.prefix_hit_rate}


@dataclass(frozen=True)
class ReplicaReport:
    """The run across replicas.

    Invariants: ``imbalance`` >= 1 (1.0 = every replica of a lane served the same number of requests): the
    largest, over lanes, of max / mean requests per replica of that lane (lanes serve different traffic by
    design, so they are not compared with each other); None without request counts or requests.
    ``prefix_spread`` in [1, number of replicas]: the mean number of distinct replicas that served each prefix
    group with at least two served requests (1.0 = perfect affinity); None when no request says its replica.
    ``hit_rate``: prefix-cache hits / queries summed over replicas. ``offered_reuse``: the share of prompt
    tokens a perfect prefix cache could have served (see :func:`offered_reuse`); None without prefix share.
    """

    source: str
    routed: bool
    replicas: tuple[ReplicaStats, ...]
    imbalance: float | None
    prefix_spread: float | None
    num_prefix_groups: int
    hit_rate: float | None
    offered_reuse: float | None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "routed": self.routed, "num_replicas": len(self.replicas),
                "imbalance": self.imbalance, "prefix_spread": self.prefix_spread,
                "num_prefix_groups": self.num_prefix_groups, "hit_rate": self.hit_rate,
                "offered_reuse": self.offered_reuse, "error": self.error,
                "per_replica": [r.to_json() for r in self.replicas]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> ReplicaReport:
        """Inverse of :meth:`to_json` (the doctor reads result files with it)."""
        stats = tuple(ReplicaStats(**{k: v for k, v in r.items() if k != "prefix_hit_rate"})
                      for r in d.get("per_replica") or [])
        return ReplicaReport(str(d.get("source", "")), bool(d.get("routed")), stats, d.get("imbalance"),
                             d.get("prefix_spread"), int(d.get("num_prefix_groups") or 0), d.get("hit_rate"),
                             d.get("offered_reuse"), d.get("error"))


def _delta(samples: list[ReplicaSample], rid: str, key: str) -> float | None:
    """Last - first value of a counter over the scrapes that reached the replica. A labelled counter appears
    on its first increment (``vllm:request_success_total{finished_reason=...}``), so a scrape that reached
    the replica without the series counts it as 0; None when the series never appeared or one scrape only."""
    seen = [s.replicas[rid].values for s in samples if rid in s.replicas]
    if len(seen) < 2 or not any(key in v for v in seen):
        return None
    return seen[-1].get(key, 0.0) - seen[0].get(key, 0.0)


def _gauge(samples: list[ReplicaSample], rid: str, key: str) -> tuple[float | None, float | None]:
    during = [s for s in samples if s.phase == "during"] or samples
    vals = [s.replicas[rid].values[key] for s in during if rid in s.replicas and key in s.replicas[rid].values]
    return (sum(vals) / len(vals), max(vals)) if vals else (None, None)


def imbalance(counts: Iterable[tuple[str | None, int]]) -> float | None:
    """max / mean requests per replica within each lane, the worst lane; ``counts`` are (lane, requests)
    per replica. None when no lane served a request."""
    lanes: dict[str | None, list[int]] = {}
    for lane, n in counts:
        lanes.setdefault(lane, []).append(n)
    ratios = [max(ns) / (sum(ns) / len(ns)) for ns in lanes.values() if sum(ns) > 0]
    return max(ratios) if ratios else None


def prefix_spread(records: Iterable[RequestRecord]) -> tuple[float | None, int]:
    """(mean distinct replicas per prefix group, number of groups counted): successful requests that name
    their replica, in groups of :data:`PREFIX_GROUP_PREFIXES` with at least two such requests."""
    served: dict[str, list[str]] = {}
    for r in records:
        if r.ok and r.replica is not None and r.group_id and r.group_id.startswith(PREFIX_GROUP_PREFIXES):
            served.setdefault(r.group_id, []).append(r.replica)
    groups = [set(reps) for reps in served.values() if len(reps) >= 2]
    return (sum(len(g) for g in groups) / len(groups), len(groups)) if groups else (None, 0)


def offered_reuse(records: Iterable[RequestRecord], prefix_share: float | None) -> float | None:
    """Share of the successful requests' prompt tokens a perfect prefix cache (one cache, or routing with
    perfect affinity) could have served: ``prefix_share`` of each prompt of a prefix group sent after an
    earlier request of its group had its first token (its prefix was computed and cached by then; requests
    sent together with the first cannot reuse it in any engine). None without ``prefix_share`` (the
    shared-prefix dataset's prefix_len / input_len) or prompt tokens."""
    ok = [r for r in records if r.ok and r.num_prompt_tokens]
    total = sum(r.num_prompt_tokens or 0 for r in ok)
    if prefix_share is None or total <= 0:
        return None
    cached_at: dict[str, float] = {}
    for r in ok:
        took = r.ttft_ms if r.ttft_ms is not None else r.e2e_ms
        if r.group_id is not None and took is not None:
            cached_at[r.group_id] = min(r.sent_s + took / 1000.0, cached_at.get(r.group_id, math.inf))
    share = min(1.0, max(0.0, prefix_share))
    reusable = sum(share * (r.num_prompt_tokens or 0) for r in ok
                   if r.group_id is not None and r.group_id.startswith(PREFIX_GROUP_PREFIXES)
                   and r.group_id in cached_at and r.sent_s >= cached_at[r.group_id])
    return reusable / total


def build_report(records: list[RequestRecord], samples: list[ReplicaSample], plan: ReplicaPlan | None,
                 prefix_share: float | None = None, error: str | None = None) -> ReplicaReport | None:
    """The run's report; None when neither a plan nor any record names a replica (a plain single server).

    Replicas are those scraped plus those named by records. Request counts come from the records when they
    name replicas the scrapes know (or nothing was scraped); else, as with a Ray endpoint scraped by URL, from
    each replica's ``vllm:request_success_total`` delta.
    """
    served = Counter(r.replica for r in records if r.ok and r.replica is not None)
    if plan is None and not served:
        return None
    lanes: dict[str, str | None] = {}
    for s in samples:
        for rid, rep in s.replicas.items():
            lanes[rid] = lanes.get(rid) or rep.lane
    if plan is not None and plan.urls:
        for url in plan.urls:
            lanes.setdefault(replica_id(url), None)
    from_records = bool(served) and (not lanes or bool(set(served) & set(lanes)))
    ids = list(lanes) + ([rid for rid in served if rid not in lanes] if from_records else [])
    source = SOURCE_ROUTED if plan is not None and plan.route else SOURCE_HEADER
    stats = []
    for rid in ids:
        requests = _delta(samples, rid, "requests_ok")
        if from_records:
            num, how = served.get(rid, 0), source
        else:
            num, how = (round(requests), SOURCE_COUNTER) if requests is not None else (None, None)
        running, waiting = _gauge(samples, rid, "running"), _gauge(samples, rid, "waiting")
        stats.append(ReplicaStats(rid, lanes.get(rid), num, how, _delta(samples, rid, "prompt_tokens"),
                                  _delta(samples, rid, "prefix_hits"), _delta(samples, rid, "prefix_queries"),
                                  *running, *waiting))
    known = [(s.lane, s.num_requests) for s in stats if s.num_requests is not None]
    spread, num_groups = prefix_spread(records) if from_records else (None, 0)
    pairs = [(h, q) for s in stats if (h := s.prefix_hits) is not None and (q := s.prefix_queries) is not None]
    queries = sum(q for _, q in pairs)
    return ReplicaReport(
        source=plan.source if plan is not None else f"{SOURCE_HEADER} header",
        routed=plan is not None and plan.route, replicas=tuple(stats),
        imbalance=imbalance(known) if known else None, prefix_spread=spread, num_prefix_groups=num_groups,
        hit_rate=sum(h for h, _ in pairs) / queries if queries > 0 else None,
        offered_reuse=offered_reuse(records, prefix_share), error=error)
