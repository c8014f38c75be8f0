"""The KV offload tiers' bookkeeping (issue #49): where evicted prefix blocks live once they leave the block pool.

When the block pool evicts a cached block (a full block registered under its chained hash) to reuse it, its K/V
is first saved to a bounded host-memory tier (pinned memory on CUDA, a separate RAM pool on CPU), and, when the
host tier itself evicts an entry, optionally demoted to a local-disk tier. When a new request's leading block
hashes miss the pool but are found in a tier, the KV manager allocates pool blocks for them and has their K/V
copied back instead of recomputed. This module only keeps the metadata (which hash is in which slot, LRU
order) and writes the copy orders; the model runner (model/kv_offload.py) executes them, so the engine stays
torch-free.

Copy orders of one step (OffloadOrders), executed by the runner before the step's forward, in this order:
  demotes     host slot -> disk slot   (before a save overwrites the host slot)
  saves       pool block -> host slot  (before the block is reused: this step's forward or a load writes it)
  disk_saves  pool block -> disk slot  (idem, when every host entry is pinned in this step)
  loads       host slot -> pool block  (before the forward reads the block)
  disk_loads  disk slot -> pool block  (idem)
  beside_loads, beside_disk_loads: the same, but run beside the step's forward (after the lists above), for
              prefetches: blocks of a waiting request that no request of this step reads (kv_manager.py's
              prefetch), so a returning turn's copy overlaps the running requests' step instead of lengthening it
Each list is executed as one batch, so within one step no slot or block may be written twice or written after
being read: an entry saved, demoted or loaded in the step is pinned until the orders are taken (take_orders),
and a tier never evicts a pinned entry (a save that finds only pinned entries goes straight to the disk tier,
or without one is dropped: the block is then simply forgotten, as without offload). Tiers are inclusive: a
block loaded back stays in its tier, so evicting it from the pool again costs no copy.

Events (kv_events.py, vLLM's `medium` field): a tier records BlockStored when it takes a hash and BlockRemoved
when it drops one, under its medium ("CPU" for the host tier, "STORAGE" for the disk tier, as vLLM names a
storage tier); replaying the events of one medium gives exactly that tier's hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvpilot.engine.block_pool import ROOT_PARENT_HASH
from kvpilot.engine.kv_events import KVEventLog

HOST_MEDIUM = "CPU"  # vLLM's name for its CPU offload tier (the pool's own blocks are "GPU", on CPU engines too)
DISK_MEDIUM = "STORAGE"


class OffloadIntegrityError(RuntimeError):
    """The offload tiers' bookkeeping is inconsistent: a kvpilot bug; the message says which invariant broke."""


@dataclass(slots=True)
class _Entry:
    slot: int
    parent_hash: int
    token_ids: tuple[int, ...]


@dataclass
class OffloadOrders:
    """One step's copy orders (module docstring): pairs of (source, destination) indices."""

    demotes: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    disk_saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    disk_loads: list[tuple[int, int]] = field(default_factory=list)
    beside_loads: list[tuple[int, int]] = field(default_factory=list)
    beside_disk_loads: list[tuple[int, int]] = field(default_factory=list)
    prefetch_ids: list[str] = field(default_factory=list)  # the requests whose blocks the beside loads fill

    def __bool__(self) -> bool:
        return bool(self.demotes or self.saves or self.disk_saves or self.loads or self.disk_loads
                    or self.beside_loads or self.beside_disk_loads)

    @property
    def has_beside_loads(self) -> bool:
        return bool(self.beside_loads or self.beside_disk_loads)


@dataclass
class OffloadStats:
    """Cumulative tier traffic, in blocks: saved to the host tier, demoted to disk (from the host tier, or
    saved straight there when every host entry was pinned), loaded back from each, and saves dropped because
    every entry of the tiers was pinned in that step."""

    num_saved: int = 0
    num_demoted: int = 0
    num_loaded: int = 0
    num_disk_loaded: int = 0
    num_dropped: int = 0
    num_loaded_beside: int = 0  # of the loads from either tier, those run beside another step (prefetches)


class OffloadTier:
    """num_slots slots, each holding one block's K/V under its chained hash; least recently used evicted first.

    Invariants (check_integrity): every slot is either free or held by exactly one hash; a pinned hash is held.
    A hash is stored with its parent hash and token ids, and a lookup trusts only all three (as the pool does).
    """

    def __init__(self, num_slots: int, medium: str, events: KVEventLog | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"an offload tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.medium = medium
        self.events = events
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    @property
    def hashes(self) -> set[int]:
        return set(self._entries)

    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The slot holding exactly token_ids after parent_hash, or None (no side effects)."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.token_ids != token_ids or entry.parent_hash != parent_hash:
            return None
        return entry.slot

    def use(self, block_hash: int) -> int:
        """Marks a held hash most recently used and pins it for this step; returns its slot."""
        self._entries.move_to_end(block_hash)
        self._pinned.add(block_hash)
        return self._entries[block_hash].slot

    def store(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]
              ) -> tuple[int, tuple[int, int, tuple[int, ...], int] | None] | None:
        """Takes a slot for the hash (pinned for this step): a free one, else the least recently used unpinned
        entry's, which is evicted. Returns (slot, the evicted entry as (hash, parent, tokens, slot) or None), or
        None when every slot is pinned. The caller must not store a hash the tier holds (use() it instead)."""
        if block_hash in self._entries:
            raise OffloadIntegrityError(f"hash {block_hash} stored twice in the {self.medium} tier")
        evicted = None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h in self._entries if h not in self._pinned), None)
            if victim is None:
                return None
            entry = self._entries.pop(victim)
            slot = entry.slot
            evicted = (victim, entry.parent_hash, entry.token_ids, slot)
            if self.events is not None:
                self.events.removed(victim, self.medium)
        self._entries[block_hash] = _Entry(slot, parent_hash, token_ids)
        self._pinned.add(block_hash)
        if self.events is not None:
            self.events.stored(block_hash, None if parent_hash == ROOT_PARENT_HASH else parent_hash, token_ids,
                               self.medium)
        return slot, evicted

    def unpin_all(self) -> None:
        self._pinned.clear()

    def drop_slots(self, slots: set[int]) -> None:
        """Forgets the hashes held in these slots (their copies never ran), freeing the slots."""
        for block_hash in [h for h, e in self._entries.items() if e.slot in slots]:
            entry = self._entries.pop(block_hash)
            self._free_slots.append(entry.slot)
            self._pinned.discard(block_hash)
            if self.events is not None:
                self.events.removed(block_hash, self.medium)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def check_integrity(self) -> None:
        slots = [e.slot for e in self._entries.values()]
        if len(set(slots)) != len(slots):
            raise OffloadIntegrityError(f"two hashes share a slot of the {self.medium} tier")
        if set(slots) & set(self._free_slots) or len(slots) + len(self._free_slots) != self.num_slots:
            raise OffloadIntegrityError(f"{self.medium} tier: {len(slots)} held + {len(self._free_slots)} free "
                                        f"slots != {self.num_slots}, or a held slot is also free")
        if any(not 0 <= s < self.num_slots for s in slots + self._free_slots):
            raise OffloadIntegrityError(f"{self.medium} tier: a slot outside 0..{self.num_slots - 1}")
        if not self._pinned <= set(self._entries):
            raise OffloadIntegrityError(f"{self.medium} tier pins a hash it does not hold")


@dataclass(frozen=True)
class TierHit:
    """A block found in an offload tier: where it is (`disk`: the disk tier, else the host tier), its slot, and
    what the pool needs to register it once loaded."""

    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    disk: bool


class OffloadTiers:
    """The host tier and the optional disk tier below it, and the copy orders of the step being scheduled."""

    def __init__(self, num_host_slots: int, num_disk_slots: int = 0, events: KVEventLog | None = None) -> None:
        self.host = OffloadTier(num_host_slots, HOST_MEDIUM, events)
        self.disk = OffloadTier(num_disk_slots, DISK_MEDIUM, events) if num_disk_slots else None
        self.stats = OffloadStats()
        self._orders = OffloadOrders()

    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> TierHit | None:
        """Where the block is, host tier first; None if in neither (no side effects)."""
        if self.host.lookup(block_hash, parent_hash, token_ids) is not None:
            return TierHit(block_hash, parent_hash, token_ids, False)
        if self.disk is not None and self.disk.lookup(block_hash, parent_hash, token_ids) is not None:
            return TierHit(block_hash, parent_hash, token_ids, True)
        return None

    def pin(self, hit: TierHit) -> None:
        """Keeps the hit's entry from being evicted in this step (before allocations that may save)."""
        (self.disk if hit.disk and self.disk is not None else self.host).use(hit.block_hash)

    def load(self, hit: TierHit, block_id: int, beside: bool = False) -> None:
        """Orders the hit's K/V copied into pool block block_id (a pinned entry: pin() first): before the
        step's forward, or with `beside` during it (a block no request of the step reads)."""
        orders = self._orders
        if hit.disk:
            if self.disk is None:
                raise OffloadIntegrityError("a disk-tier hit without a disk tier")
            (orders.beside_disk_loads if beside else orders.disk_loads).append(
                (self.disk.use(hit.block_hash), block_id))
            self.stats.num_disk_loaded += 1
        else:
            (orders.beside_loads if beside else orders.loads).append((self.host.use(hit.block_hash), block_id))
            self.stats.num_loaded += 1
        self.stats.num_loaded_beside += beside

    def prefetching(self, request_id: str) -> None:
        """Names the request whose blocks this step's beside loads fill (kv_manager.py's prefetch)."""
        self._orders.prefetch_ids.append(request_id)

    def save(self, block_id: int, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> None:
        """The pool is about to reuse block_id, which holds block_hash: keep its K/V in the host tier (no copy
        when the tier holds the hash already: it is only marked recently used)."""
        if block_hash in self.host:
            self.host.use(block_hash)
            return
        stored = self.host.store(block_hash, parent_hash, token_ids)
        if stored is None:  # every host entry pinned in this step: straight to disk, if there is one
            if not self._to_disk(block_hash, parent_hash, token_ids, self._orders.disk_saves, block_id):
                self.stats.num_dropped += 1
            return
        slot, evicted = stored
        if evicted is not None and self.disk is not None:
            self._to_disk(*evicted[:3], self._orders.demotes, evicted[3])
        self._orders.saves.append((block_id, slot))
        self.stats.num_saved += 1

    def _to_disk(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...],
                 orders: list[tuple[int, int]], source: int) -> bool:
        """Keeps the hash in the disk tier, copied from `source` (a host slot for a demote, a pool block for
        a disk save) by an order in `orders`; False when there is no disk tier or every entry is pinned."""
        if self.disk is None:
            return False
        if block_hash in self.disk:
            self.disk.use(block_hash)
            return True
        stored = self.disk.store(block_hash, parent_hash, token_ids)
        if stored is None:
            return False
        orders.append((source, stored[0]))
        self.stats.num_demoted += 1
        return True

    def take_orders(self) -> OffloadOrders | None:
        """The step's copy orders (None when nothing moved); unpins every entry for the next step."""
        orders = None
        if self._orders:
            orders, self._orders = self._orders, OffloadOrders()
        self.host.unpin_all()
        if self.disk is not None:
            self.disk.unpin_all()
        return orders

    def discard(self, orders: OffloadOrders) -> None:
        """A step whose copies may not have run (its launch failed): the tier entries they were to fill are
        forgotten (the pool's loaded blocks are the KV manager's to forget)."""
        self.host.drop_slots({slot for _, slot in orders.saves})
        if self.disk is not None:
            self.disk.drop_slots({slot for _, slot in orders.demotes + orders.disk_saves})

    def check_integrity(self) -> None:
        """Both tiers consistent, and (between steps) nothing pinned and no order pending."""
        for tier in (self.host, self.disk):
            if tier is None:
                continue
            tier.check_integrity()
            if tier.num_pinned:
                raise OffloadIntegrityError(f"{tier.num_pinned} entries of the {tier.medium} tier pinned "
                                            "between steps")
        if self._orders:
            raise OffloadIntegrityError("copy orders left untaken between steps")
