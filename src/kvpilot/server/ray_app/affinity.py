"""Replica choice for prefix-cache reuse: consistent hashing on prefix hashes with a load bound.

PrefixAffinity remembers which replica each prefix chunk hash (prefix_key.route_key) was last sent to. A
request goes to the replica holding its longest remembered prefix; a new prefix goes around a hash ring
(virtual nodes) from its first chunk's hash, so it lands on a stable replica and replicas that come and go
move few prefixes. Two bounds (Mirrokni et al., "consistent hashing with bounded loads"), c = load_factor:
- in flight: a replica takes a request only while its in-flight count + 1 <= max(ceil(c * (total + 1) / n),
  min_load_bound), so a hot prefix spills to the next replica instead of queueing, while a lightly loaded
  replica still batches a few requests of its prefixes (some replica always qualifies);
- cached prefixes: a new prefix skips, on the ring, replicas that own more than ceil(c * mean) of the
  remembered chunks with it, so prefixes (and the KV cache they fill) spread evenly, not by hash luck.

Invariants: `rank` returns every candidate exactly once, the chosen one first; loads count requests
routed (or reserved: chosen, not yet routed) and not yet completed, per replica, never below zero; the
table holds at most max_entries hashes (LRU) and `owned` counts its entries per replica.
Plain Python: the Ray RequestRouter (router.py) drives it from its hooks.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Sequence

VIRTUAL_NODES = 64
DEFAULT_MAX_ENTRIES = 200_000
DEFAULT_MIN_LOAD_BOUND = 4  # below this many in flight, a replica is never "overloaded" (it batches them)


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


RESERVATION_TTL_S = 10.0  # a reservation whose request was never routed (cancelled first) stops counting


class LoadTracker:
    """In-flight requests per replica, as this router sent them, plus reservations: a replica chosen for a
    request not yet routed counts at once, so requests chosen in a burst, before Ray reports the first one
    routed, spread instead of all taking the replica that looked idle."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.loads: dict[str, int] = {}
        self.reserved: dict[Hashable, tuple[str, float]] = {}
        self.clock = clock

    def reserve(self, token: Hashable, replica_id: str) -> None:
        """Counts `replica_id` as chosen for the request `token` until `settle(token)` (a new choice for
        the same token replaces the old one)."""
        self.settle(token)
        now = self.clock()
        for stale in [t for t, (_, since) in self.reserved.items() if now - since > RESERVATION_TTL_S]:
            self.settle(stale)
        self.reserved[token] = (replica_id, now)
        self.routed(replica_id)

    def settle(self, token: Hashable) -> None:
        entry = self.reserved.pop(token, None)
        if entry is not None:
            self.completed(entry[0])

    def routed(self, replica_id: str) -> None:
        self.loads[replica_id] = self.loads.get(replica_id, 0) + 1

    def completed(self, replica_id: str) -> None:
        if self.loads.get(replica_id, 0) > 0:
            self.loads[replica_id] -= 1

    def forget(self, replica_id: str) -> None:
        self.loads.pop(replica_id, None)

    def load(self, replica_id: str) -> int:
        return self.loads.get(replica_id, 0)

    def by_load(self, replica_ids: Sequence[str]) -> list[str]:
        return sorted(replica_ids, key=lambda r: (self.load(r), r))


class PrefixAffinity:
    """See the module docstring. `rank(key, candidates)` then `routed(key, chosen)`; `completed(replica)`
    when its request ends; `forget(replica)` when it dies."""

    def __init__(self, load_factor: float = 1.25, max_entries: int = DEFAULT_MAX_ENTRIES,
                 min_load_bound: int = DEFAULT_MIN_LOAD_BOUND) -> None:
        if load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.load_factor, self.max_entries, self.min_load_bound = load_factor, max_entries, min_load_bound
        self.tracker = LoadTracker()
        self.table: OrderedDict[int, str] = OrderedDict()
        self.owned: dict[str, int] = {}  # table entries per replica: a proxy for its cached prefixes
        self.num_affinity_hits = 0  # requests sent to the replica of a remembered prefix
        self._ring: tuple[tuple[str, ...], list[tuple[int, str]]] = ((), [])

    def rank(self, key: Sequence[int], candidate_ids: Sequence[str]) -> list[str]:
        if not candidate_ids:
            return []
        n = len(candidate_ids)
        load_bound = max(math.ceil(self.load_factor * (sum(self.tracker.load(r) for r in candidate_ids) + 1) / n),
                         self.min_load_bound)
        fits_load = [r for r in candidate_ids if self.tracker.load(r) + 1 <= load_bound]
        holder = self.holder(key, set(candidate_ids))
        if holder in fits_load:
            chosen = holder
        else:  # a new prefix (or its holder is overloaded): around the ring, to a replica with room
            # no key (a prompt shorter than a chunk): nothing to reuse, so the least loaded
            ring = _ring_order(key[0], self._ring_of(sorted(candidate_ids))) if key else self.tracker.by_load(fits_load)
            size_bound = math.ceil(self.load_factor * (sum(self.owned.get(r, 0) for r in candidate_ids)
                                                       + len(key)) / n)
            roomy = [r for r in ring if r in fits_load and self.owned.get(r, 0) + len(key) <= size_bound]
            chosen = next(iter(roomy or [r for r in ring if r in fits_load]),
                          self.tracker.by_load(candidate_ids)[0])
        return [chosen] + self.tracker.by_load([r for r in candidate_ids if r != chosen])

    def _ring_of(self, replica_ids: list[str]) -> list[tuple[int, str]]:
        """The ring of VIRTUAL_NODES points a replica, rebuilt only when the replica set changes."""
        if self._ring[0] != tuple(replica_ids):
            ring = sorted((_point(f"{r}#{v}"), r) for r in replica_ids for v in range(VIRTUAL_NODES))
            self._ring = (tuple(replica_ids), ring)
        return self._ring[1]

    def holder(self, key: Sequence[int], candidates: set[str]) -> str | None:
        """The live replica remembered for the longest prefix of `key`, or None."""
        for h in reversed(key):
            replica = self.table.get(h)
            if replica in candidates:
                return replica
        return None

    def routed(self, key: Sequence[int], replica_id: str) -> None:
        self.tracker.routed(replica_id)
        self.num_affinity_hits += self.holder(key, {replica_id}) is not None
        for h in key:
            self._set(h, replica_id)
        while len(self.table) > self.max_entries:
            self._drop(self.table.popitem(last=False)[1])

    def _set(self, h: int, replica_id: str) -> None:
        previous = self.table.get(h)
        if previous is not None:
            self._drop(previous)
        self.table[h] = replica_id
        self.table.move_to_end(h)
        self.owned[replica_id] = self.owned.get(replica_id, 0) + 1

    def _drop(self, replica_id: str) -> None:
        self.owned[replica_id] -= 1

    def completed(self, replica_id: str) -> None:
        self.tracker.completed(replica_id)

    def forget(self, replica_id: str) -> None:
        """A dead replica's prefixes are gone with its KV cache: they go back to the ring."""
        self.tracker.forget(replica_id)
        self.owned.pop(replica_id, None)
        for h in [h for h, r in self.table.items() if r == replica_id]:
            del self.table[h]


def _ring_order(point: int, ring: list[tuple[int, str]]) -> list[str]:
    """Replicas in the order met walking the ring clockwise from `point`."""
    replica_ids = {r for _, r in ring}
    start = bisect.bisect_left(ring, (point, ""))
    order: list[str] = []
    for i in range(len(ring)):
        replica = ring[(start + i) % len(ring)][1]
        if replica not in order:
            order.append(replica)
            if len(order) == len(replica_ids):
                break
    return order


class RoundRobin:
    """The prefix-blind baseline: candidates in turn (sorted ids), whatever the prompt."""

    def __init__(self) -> None:
        self.tracker = LoadTracker()
        self.turn = 0

    def rank(self, key: Sequence[int], candidate_ids: Sequence[str]) -> list[str]:
        if not candidate_ids:
            return []
        ordered = sorted(candidate_ids)
        first = ordered[self.turn % len(ordered)]
        self.turn += 1
        return [first] + [r for r in ordered if r != first]

    def routed(self, key: Sequence[int], replica_id: str) -> None:
        self.tracker.routed(replica_id)

    def completed(self, replica_id: str) -> None:
        self.tracker.completed(replica_id)

    def forget(self, replica_id: str) -> None:
        self.tracker.forget(replica_id)
