"""KVCacheManager: block tables of requests over the BlockPool: prefix lookup, allocation, caching, freeing.

The scheduler sees only block ids and token counts; KVBlock objects stay inside this module and the pool.

Sliding window (CacheConfig.sliding_window = W: group 0's layers slide, see KV groups below): a query at position p
reads keys j with p - W < j <= p, so once a request's next query is at position c, its blocks wholly before
position c - W + 1 are never read again. allocate_slots releases them to the pool (a block holding a cached
prefix stays cached-evictable, so another request can still hit it) and leaves NULL_BLOCK_ID in their place
in the table, keeping block index == position // block_size. Placeholders only ever form a leading run.

The placeholder contract with attention: NULL_BLOCK_ID (0) is a real block index, so reading it is memory-safe,
but it may hold another request's K/V; so may an id the runner keeps for a released block (RunningRequestData
only appends, so the runner's row still holds the old id). Attention must give every key j <= p - W of a query
at p zero weight without reading meaning into its slot: skip those blocks, or mask their scores to -inf
(the cache is zero-initialised and only ever holds finite K/V, so a masked read cannot turn into NaN).
Nothing is ever written through a placeholder: a step's new tokens lie in blocks allocated for them.
KV groups (engine/kv_groups.py: interleaved models such as Gemma 2/3 and gpt-oss): group 0 is the table
above (request.block_ids); groups 1.. each keep a table of their own (request.extra_block_ids), of the same
length, over the same pool, with their own window. Every allocation takes as many new blocks in each group; a
prefix hit of n blocks must hold in every group (a full group: blocks 0..n-1 cached; a sliding one: its
window's blocks), and a group's cached blocks are found under the block's hash salted with the group (one
block id holds one group's layers, so group 1's block for a prefix is not group 0's). KV events report group
0's blocks only, so a router sees one hash per prefix block. KV offload and disaggregation serve one group.

KV offload prefetch (kv_offload.py): a waiting request whose prefix hit lies partly in an offload tier can have
those blocks loaded beside a step of other requests (prefetch) instead of before one: the loads then overlap
that step's forward rather than lengthening it. While that step is in flight the prefetch holds a reference on
every block of the hit (the pool's hits too, so none is evicted meanwhile); once it has run
(finish_prefetches) the loaded blocks are registered under their hashes (before that no reader may find
them) and every reference is dropped, the blocks joining the free queue's tail still cached, so the request,
admitted at a later step, finds its whole hit in the pool. Holding nothing across steps keeps a waiting
request from pinning blocks that running or preempted requests need. On a CPU a round loads at most the blocks
whose copy hides behind one step (load_pacing.py); the request takes further rounds in the next steps while each
leaves fewer of its blocks in a tier. A round that made no progress (its blocks were evicted again before the
next) ends the prefetching: what is left is loaded before the request's own step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.block_pool import (
    ROOT_PARENT_HASH,
    BlockCounts,
    BlockPool,
    HashFn,
    KVCacheIntegrityError,
    chained_block_hash,
)
from kvpilot.engine.config import CacheConfig, cdiv
from kvpilot.engine.kv_block import KVBlock
from kvpilot.engine.kv_groups import group_block_hash
from kvpilot.engine.kv_events import KVEventLog
from kvpilot.engine.kv_offload import OffloadOrders, OffloadTiers, TierHit
from kvpilot.engine.kv_transfer import KVLoad, PulledKV
from kvpilot.engine.load_pacing import LoadPacer
from kvpilot.engine.request import Request

# The block id a request's table holds where a block fell out of its sliding window (module docstring).
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class PrefixHit:
    """Result of a prefix-cache lookup: the leading cached blocks and the tokens they cover (a block multiple).

    With a sliding window the leading entries may be None: blocks wholly before the window of the first
    token to compute, which the request never reads (placeholders, NULL_BLOCK_ID in block_ids). With KV
    offload, `tier_hits` lists (index, TierHit) for the blocks found in an offload tier instead of the pool
    (None in `blocks` until allocate_slots loads them into new pool blocks); they count in num_tokens.
    """

    blocks: tuple[KVBlock | None, ...] = ()
    num_tokens: int = 0
    num_query_tokens: int = 0
    tier_hits: tuple[tuple[int, TierHit], ...] = ()
    remote: PulledKV | None = None  # disaggregation: num_tokens pulled from a prefill worker, in new blocks
    num_prefetched_tier_blocks: int = 0  # of the pool's blocks, those a prefetch loaded from a tier
    extra_blocks: tuple[tuple[KVBlock | None, ...], ...] = ()  # KV groups 1..: the hit's blocks in each

    @property
    def block_ids(self) -> list[int]:
        """The pool blocks' ids (NULL_BLOCK_ID for placeholders and for blocks still in a tier)."""
        return [NULL_BLOCK_ID if b is None else b.block_id for b in self.blocks]

    @property
    def num_tier_blocks(self) -> int:
        """Blocks of the hit that come from an offload tier: to load now, or loaded by a prefetch."""
        return len(self.tier_hits) + self.num_prefetched_tier_blocks


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups in tokens, like vLLM's vllm:prefix_cache_queries / _hits counters."""

    num_queries: int = 0
    num_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


@dataclass
class _Prefetch:
    """A waiting request's prefix hit held in the pool while its loads run: `blocks` (each referenced once by
    the prefetch), of which `loaded` were ordered copied from a tier (with their tier entries), at `indices` of
    the hit."""

    blocks: list[KVBlock]
    loaded: list[tuple[KVBlock, TierHit]]
    indices: list[int]


@dataclass
class _Rounds:
    """A waiting request's prefetch rounds so far: how many tier blocks its hit had when the first round began
    (the pacer's floor) and when the last one began (a next round must find fewer), and the indices of its
    hit's blocks the finished rounds loaded (counted as tier hits while the pool holds them)."""

    num_first_tier_blocks: int
    num_last_tier_blocks: int
    loaded_indices: set[int] = field(default_factory=set)


@dataclass
class _Table:
    """One request's blocks, how many leading ones are registered in the prefix cache, and how many leading
    ones are placeholders (None: released, out of the sliding window; blocks[:num_null_blocks] only). `extra`:
    with KV groups, the tables of groups 1.. (each as long as this one; their own `extra` empty)."""

    blocks: list[KVBlock | None] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_null_blocks: int = 0
    extra: list[_Table] = field(default_factory=list)

    def all_blocks(self) -> list[KVBlock]:
        """Every block the table holds (placeholders left out), last position first and, at each position,
        every group's block: freed in this order, a prefix's tail is evicted before its head in all groups
        alike (a hit needs every group's blocks)."""
        if not self.extra:
            return [b for b in reversed(self.blocks) if b is not None]
        tables = [self.blocks, *(t.blocks for t in self.extra)]
        return [b for i in range(len(self.blocks) - 1, -1, -1) for t in tables if (b := t[i]) is not None]


class KVCacheManager:
    """Owns every request's block table; mirrors the ids into request.block_ids.

    Invariants: each block's ref_cnt equals the number of tables holding it; a table covers at least the
    request's computed tokens; only full blocks whose K/V has been computed are registered for reuse; with a
    sliding window, placeholders lead the table and stand only for blocks wholly before the window of the
    request's computed tokens (never one its next query reads).
    """

    def __init__(self, cache_config: CacheConfig, *, hash_fn: HashFn = chained_block_hash) -> None:
        self.block_size = cache_config.block_size
        self.sliding_window = cache_config.sliding_window
        self.extra_windows = cache_config.extra_group_windows  # KV groups 1.. (module docstring)
        self.group_windows = cache_config.group_windows  # every group's, group 0's first
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        events = KVEventLog(cache_config.block_size) if cache_config.enable_kv_cache_events else None
        # KV offload (kv_offload.py): evicted prefix blocks are saved to a host tier, found there by later hits
        self.offload = OffloadTiers(cache_config.num_offload_blocks, cache_config.num_disk_offload_blocks,
                                    events) if cache_config.offload_enabled else None
        self.pool = BlockPool(cache_config.num_blocks, hash_fn=hash_fn, events=events,
                              on_evict=self._save_evicted if self.offload is not None else None)
        self.prefix_stats = PrefixCacheStats()  # the pool's own hits
        self.offload_prefix_stats = PrefixCacheStats()  # hits copied back from an offload tier
        self._tables: dict[str, _Table] = {}
        # disaggregation (engine/kv_transfer.py): finished requests' tables kept for a decode worker to pull,
        # and this step's copies of pulled K/V into new blocks
        self._held: dict[str, _Table] = {}
        self._kv_loads: list[KVLoad] = []
        self._prefetches: dict[str, _Prefetch] = {}  # waiting requests' prefix hits whose loads are in flight
        self._rounds: dict[str, _Rounds] = {}  # waiting requests that took a prefetch round
        self.pacer = LoadPacer() if cache_config.pace_offload_loads and self.offload is not None else None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached-but-idle blocks count as free), vLLM's kv_cache_usage."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_counts(self) -> BlockCounts:
        return self.pool.counts()

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """Longest run of cached full blocks at the start of request.all_token_ids (no side effects).

        The hit stops one token short of the end: the last token is always computed so there are logits to
        sample, hence at most (num_tokens - 1) // block_size blocks. With a sliding window a hit of n blocks
        needs only the blocks the first token to compute (position n * block_size) reads, so the earlier
        ones may have been evicted (_grouped_hit, as with KV groups).
        """
        if request.remote_kv is not None and not request.num_computed_tokens:
            return self._remote_hit(request, request.remote_kv)
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return PrefixHit(num_query_tokens=request.num_tokens)
        hashes = self._block_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None or self.extra_windows:
            return self._grouped_hit(request, hashes[:max_blocks])
        found: list[KVBlock | None] = []
        tier_hits: list[tuple[int, TierHit]] = []
        parent = ROOT_PARENT_HASH
        offload = self.offload
        for i, block_hash in enumerate(hashes[:max_blocks]):
            tokens = self._block_tokens(request, i)
            block = self.pool.lookup(block_hash, parent, tokens)
            if block is None:  # with offload: maybe in a tier, to be copied back (allocate_slots)
                tier_hit = offload.lookup(block_hash, parent, tokens) if offload is not None else None
                if tier_hit is None:
                    break
                tier_hits.append((i, tier_hit))
            found.append(block)
            parent = block_hash
        # blocks a prefetch round loaded count as tier hits while the pool holds them (evicted again, they are
        # among tier_hits: counted once)
        rounds = self._rounds.get(request.request_id) if self._rounds else None
        num_prefetched = sum(1 for i in rounds.loaded_indices if i < len(found) and found[i] is not None) \
            if rounds is not None else 0
        return PrefixHit(tuple(found), len(found) * self.block_size, request.num_tokens, tuple(tier_hits),
                         num_prefetched_tier_blocks=num_prefetched)

    def _remote_hit(self, request: Request, remote: PulledKV) -> PrefixHit:
        """The pulled tokens as a hit whose blocks are all new (allocate_slots orders the K/V copied in); one
        token short of the prompt at most, so there are logits to sample."""
        num_tokens = min(remote.num_tokens, request.num_tokens - 1)
        return PrefixHit((), num_tokens, request.num_tokens, remote=remote) if num_tokens > 0 else \
            PrefixHit(num_query_tokens=request.num_tokens)

    def _grouped_hit(self, request: Request, hashes: list[int]) -> PrefixHit:
        """The longest hit of n blocks usable in every KV group (_usable_lengths): in a full group blocks
        0..n-1 cached, in a sliding one the blocks the first token to compute (position n * block_size) reads,
        [num_outside(n * block_size), n), with None for the blocks before them. A sliding group looks up every
        cached block of the prompt, since an earlier miss no longer ends its search (the chained hash still
        pins each block's whole prefix)."""
        windows = self.group_windows
        present = [self._lookup_group(request, hashes, group, window) for group, window in enumerate(windows)]
        usable = [self._usable_lengths(blocks, window) for blocks, window in zip(present, windows)]
        n = max(k for k in range(len(hashes) + 1) if all(u[k] for u in usable))
        hit = []
        for blocks, window in zip(present, windows):
            first = self._num_outside(n * self.block_size, window)
            hit.append((None,) * first + tuple(blocks[first:n]))
        return PrefixHit(hit[0], n * self.block_size, request.num_tokens, extra_blocks=tuple(hit[1:]))

    def _lookup_group(self, request: Request, hashes: list[int], group: int,
                      window: int | None) -> list[KVBlock | None]:
        """The group's cached block for each of `hashes` (None where absent; a full group stops at its
        first miss, past which no hit can reach)."""
        present: list[KVBlock | None] = [None] * len(hashes)
        parent = ROOT_PARENT_HASH
        for i, block_hash in enumerate(hashes):
            present[i] = self.pool.lookup(group_block_hash(block_hash, group), parent, self._block_tokens(request, i))
            if present[i] is None and window is None:
                break
            parent = block_hash
        return present

    def _usable_lengths(self, present: list[KVBlock | None], window: int | None) -> list[bool]:
        """usable[n]: whether a hit of n blocks has every block the group reads (n = 0: always). A sliding
        group needs block n - 1 itself (always in the window when W >= 2): placeholders only would be a guess."""
        usable = [True] + [False] * len(present)
        run_start = 0  # first index of the current run of cached blocks
        for i, block in enumerate(present):
            if block is None:
                if window is None:
                    break
                run_start = i + 1
            elif run_start <= self._num_outside((i + 1) * self.block_size, window):
                usable[i + 1] = True
        return usable

    def _num_outside(self, position: int, window: int | None) -> int:
        """Leading blocks wholly before the window of a query at `position` (0 without a window)."""
        if window is None:
            return 0
        return max(0, position - window + 1) // self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix_hit: PrefixHit | None = None
    ) -> list[int] | None:
        """Grow the table to cover num_computed_tokens (+ the hit) + num_new_tokens; None if blocks run short.

        With prefix_hit (a waiting request being admitted) the hit blocks are shared first, then new blocks
        come from the head of the free queue. With a sliding window, blocks wholly before the window of the
        first token to compute are released first (so they count as free for this very allocation). On None
        no block was taken (released blocks stay released: the request never reads them again). Returns the
        ids of the new blocks.
        """
        table = self._tables.get(request.request_id)
        if table is None:
            table = _Table(extra=[_Table() for _ in self.extra_windows])
        elif prefix_hit is None and \
                request.num_computed_tokens + num_new_tokens <= len(table.blocks) * self.block_size:
            return []  # the common decode step: the last block still has room
        for group_table, window, ids in zip((table, *table.extra), self.group_windows,
                                            (request.block_ids, *request.extra_block_ids)):
            if window is not None and len(group_table.blocks) > group_table.num_null_blocks:
                self._release_outside_window(request, group_table, window, ids)
        hit = list(prefix_hit.blocks) if prefix_hit is not None else []
        tier_hits = prefix_hit.tier_hits if prefix_hit is not None else ()
        num_hit_tokens = prefix_hit.num_tokens if prefix_hit is not None else 0
        total_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_new_blocks = max(0, cdiv(total_tokens, self.block_size) - len(table.blocks) - len(hit))
        if num_new_blocks == 0 and prefix_hit is None:
            return []  # the common decode step: the last block still has room
        held = [b for b in hit if b is not None]  # a windowed hit leads with placeholders
        extra_hits = prefix_hit.extra_blocks if prefix_hit is not None else ()
        extra_held = [b for blocks in extra_hits for b in blocks if b is not None]
        num_revived = sum(1 for b in held if b.ref_cnt == 0) + \
            sum(1 for b in extra_held if b.ref_cnt == 0)  # these leave the free queue when touched
        num_taken = num_new_blocks * (1 + len(self.extra_windows)) + len(tier_hits)  # as many in each group
        if num_taken > self.pool.num_free_blocks - num_revived:
            return None
        self._tables[request.request_id] = table
        self.pool.touch(held)
        if table.extra:  # first: no allocation below may evict a block of this very hit
            self.pool.touch(extra_held)
            self._grow_extra(request, table, extra_hits, num_new_blocks)
        table.num_null_blocks += len(hit) - len(held) - len(tier_hits)  # a hit only ever starts an empty table
        if tier_hits:
            self._load_tier_hits(hit, tier_hits)
        new_blocks = self.pool.allocate(num_new_blocks)
        table.blocks.extend(hit)
        table.blocks.extend(new_blocks)
        table.num_cached_blocks = max(table.num_cached_blocks, len(hit))
        new_ids = [b.block_id for b in new_blocks]
        if prefix_hit is not None and prefix_hit.remote is not None:
            self._load_remote(request, prefix_hit, new_ids)
        elif prefix_hit is not None and self.enable_prefix_caching:
            self._count_hit(prefix_hit)
        # in place: O(new blocks), not a copy of the whole table every time a decode crosses a block boundary
        if prefix_hit is not None:
            request.block_ids.extend(NULL_BLOCK_ID if b is None else b.block_id for b in hit)
        request.block_ids.extend(new_ids)
        return new_ids

    def _grow_extra(self, request: Request, table: _Table, extra_hits: tuple[tuple[KVBlock | None, ...], ...],
                    num_new_blocks: int) -> None:
        """Extends the tables of KV groups 1.. (and their mirrors) by their part of the hit, touched already,
        then num_new_blocks new blocks each: every group's table stays as long as group 0's."""
        if not request.extra_block_ids:
            request.extra_block_ids = [[] for _ in table.extra]
        for group, (extra, ids) in enumerate(zip(table.extra, request.extra_block_ids)):
            hit = extra_hits[group] if extra_hits else ()
            new_blocks = self.pool.allocate(num_new_blocks)
            extra.num_null_blocks += sum(1 for b in hit if b is None)
            extra.blocks.extend(hit)
            extra.blocks.extend(new_blocks)
            extra.num_cached_blocks = max(extra.num_cached_blocks, len(hit))
            ids.extend(NULL_BLOCK_ID if b is None else b.block_id for b in hit)
            ids.extend(b.block_id for b in new_blocks)

    def _load_tier_hits(self, hit: list[KVBlock | None], tier_hits: tuple[tuple[int, TierHit], ...],
                        beside: bool = False) -> list[tuple[KVBlock, TierHit]]:
        """Allocates a pool block for each block of the hit found in an offload tier, orders its K/V copied
        back and, unless `beside` (a prefetch: registered once its step ran), registers it under its hash at once
        (the copy runs before this step's forward, and any later reader's step after it), filling `hit` in place.
        The tier entries are pinned first, so the saves these allocations cause never evict them. Returns the
        (block, tier entry) pairs."""
        assert self.offload is not None
        for _, tier_hit in tier_hits:
            self.offload.pin(tier_hit)
        loaded = []
        for (index, tier_hit), block in zip(tier_hits, self.pool.allocate(len(tier_hits))):
            self.offload.load(tier_hit, block.block_id, beside)
            if not beside:
                self.pool.cache_block(block, tier_hit.block_hash, tier_hit.parent_hash, tier_hit.token_ids)
            hit[index] = block
            loaded.append((block, tier_hit))
        return loaded

    # ---- prefetch: tier loads beside another step (module docstring) --------------------------------------

    def can_prefetch(self, request: Request, prefix_hit: PrefixHit) -> bool:
        """Whether prefetch() may take the hit: it has tier blocks, no round of the request is in flight, and
        an earlier round (if any) left fewer of them in a tier than it began with."""
        rounds = self._rounds.get(request.request_id)
        return bool(prefix_hit.tier_hits) and request.request_id not in self._prefetches and \
            (rounds is None or len(prefix_hit.tier_hits) < rounds.num_last_tier_blocks)

    def prefetch(self, request: Request, prefix_hit: PrefixHit) -> bool:
        """Holds the hit's pool blocks and orders its tier blocks (on a CPU the pacer's share of them: the
        leading ones) loaded into new pool blocks beside this step's forward; False (nothing taken) when the
        pool lacks free blocks for them."""
        if self.offload is None or not self.can_prefetch(request, prefix_hit):
            raise KVCacheIntegrityError(f"request {request.request_id}: nothing to prefetch, or no progress")
        num_tier_blocks = len(prefix_hit.tier_hits)
        rounds = self._rounds.get(request.request_id) or _Rounds(num_tier_blocks, num_tier_blocks)
        tier_hits = prefix_hit.tier_hits[:self.pacer.max_blocks(rounds.num_first_tier_blocks)] \
            if self.pacer is not None else prefix_hit.tier_hits
        held = [b for b in prefix_hit.blocks if b is not None]
        num_revived = sum(1 for b in held if b.ref_cnt == 0)
        if len(tier_hits) > self.pool.num_free_blocks - num_revived:
            return False
        self.pool.touch(held)  # first: the allocation below must not evict a block of this very hit
        blocks: list[KVBlock | None] = list(prefix_hit.blocks)
        loaded = self._load_tier_hits(blocks, tier_hits, beside=True)
        self.offload.prefetching(request.request_id)
        rounds.num_last_tier_blocks = num_tier_blocks
        self._rounds[request.request_id] = rounds  # recorded only once a round is under way
        self._prefetches[request.request_id] = _Prefetch([b for b in blocks if b is not None], loaded,
                                                         [index for index, _ in tier_hits])
        return True

    def observe_step(self, orders: OffloadOrders | None, seconds: float, beside_seconds: float) -> None:
        """A finished step's wall time and what its beside loads took (the pacer's cost model)."""
        if self.pacer is not None:
            num_beside = len(orders.beside_loads) + len(orders.beside_disk_loads) if orders is not None else 0
            self.pacer.observe(seconds, beside_seconds, num_beside)

    def is_prefetching(self, request_id: str) -> bool:
        """True while the step loading the request's prefetched blocks has not run (finish_prefetches)."""
        return request_id in self._prefetches

    def finish_prefetches(self, request_ids: list[str]) -> None:
        """The step carrying these requests' prefetch loads ran: their loaded blocks join the prefix cache (a
        hash another block took meanwhile stays with that block; the request then hits that one) and the
        prefetch's references are dropped, tail first (the free queue evicts a hit's tail before its head)."""
        for request_id in request_ids:
            prefetch = self._prefetches.pop(request_id, None)
            if prefetch is None:
                continue  # released meanwhile (aborted, or admitted alone after a failure)
            for block, tier_hit in prefetch.loaded:
                self.pool.cache_block(block, tier_hit.block_hash, tier_hit.parent_hash, tier_hit.token_ids)
            self.pool.free(list(reversed(prefetch.blocks)))
            self._rounds[request_id].loaded_indices.update(prefetch.indices)

    def release_prefetch(self, request_id: str) -> None:
        """Forgets the request's prefetch (at its admission, when it ends, or when the step carrying its loads
        failed): references still held are dropped, and blocks whose loads may not have run leave
        unregistered. No-op without one."""
        self._rounds.pop(request_id, None)
        prefetch = self._prefetches.pop(request_id, None)
        if prefetch is not None:
            self.pool.free(list(reversed(prefetch.blocks)))

    @property
    def num_prefetched_blocks(self) -> int:
        return sum(len(p.blocks) for p in self._prefetches.values())

    def _load_remote(self, request: Request, prefix_hit: PrefixHit, new_ids: list[int]) -> None:
        """Orders the pulled K/V copied into the first new blocks (before this step's forward) and consumes it:
        a request preempted later recomputes its tokens like any other."""
        remote = prefix_hit.remote
        assert remote is not None
        num_blocks = cdiv(prefix_hit.num_tokens, self.block_size)
        # bytes a block, or for a device tensor [blocks, ...] (a same-host transport's) one row a block
        per_block = len(remote.data) // remote.num_blocks
        data = remote.data if num_blocks == remote.num_blocks else remote.data[:num_blocks * per_block]
        self._kv_loads.append(KVLoad(tuple(new_ids[:num_blocks]), data))
        request.remote_kv = None
        request.num_kv_transfer_tokens = prefix_hit.num_tokens
        request.kv_transfer_time = remote.transfer_s

    def take_kv_loads(self) -> tuple[KVLoad, ...]:
        """The step's copies of pulled K/V into pool blocks (disaggregation), () when none."""
        if not self._kv_loads:
            return ()
        loads, self._kv_loads = tuple(self._kv_loads), []
        return loads

    def hold(self, request: Request) -> list[int]:
        """Keeps a finishing request's blocks (ref counts and all) for a decode worker to pull: they are
        neither evicted nor reused until release_held. Returns their ids."""
        table = self._tables.pop(request.request_id, None)
        request.block_ids = []
        request.extra_block_ids = []
        if table is None:
            return []
        self.release_held(request.request_id)  # an id reused while its old blocks wait: those are given up
        self._held[request.request_id] = table
        return [b.block_id for b in table.blocks if b is not None]

    def release_held(self, request_id: str) -> bool:
        """Frees the blocks held for request_id (pulled, failed or timed out); False when none are held."""
        table = self._held.pop(request_id, None)
        if table is None:
            return False
        self.pool.free(table.all_blocks())
        return True

    @property
    def num_held_blocks(self) -> int:
        return sum(len(t.blocks) for t in self._held.values())

    def _count_hit(self, prefix_hit: PrefixHit) -> None:
        """vLLM's counters, in tokens: prefix_cache_queries/_hits for the pool, and with offload
        external_prefix_cache_queries/_hits for the tiers (every admission queries both)."""
        num_tier_tokens = prefix_hit.num_tier_blocks * self.block_size
        self.prefix_stats.num_queries += prefix_hit.num_query_tokens
        self.prefix_stats.num_hits += prefix_hit.num_tokens - num_tier_tokens
        if self.offload is not None:
            self.offload_prefix_stats.num_queries += prefix_hit.num_query_tokens
            self.offload_prefix_stats.num_hits += num_tier_tokens

    def _save_evicted(self, block: KVBlock) -> None:
        """The pool's eviction hook: the cached block is about to be reused, so its K/V goes to the host tier."""
        assert self.offload is not None and block.block_hash is not None and block.parent_hash is not None
        self.offload.save(block.block_id, block.block_hash, block.parent_hash, block.token_ids)

    def discard_offload(self, orders: OffloadOrders) -> None:
        """The step carrying these copy orders failed to launch, so they may not have run: tier slots they were
        to fill are forgotten, and so are the hashes of the pool blocks they were to load (their requests are
        rolled back and recompute them)."""
        assert self.offload is not None
        self.offload.discard(orders)
        for _, block_id in orders.loads + orders.disk_loads:
            self.pool.drop_hash(self.pool.blocks[block_id])
        for request_id in orders.prefetch_ids:
            self.release_prefetch(request_id)

    def take_offload_orders(self) -> OffloadOrders | None:
        """The copy orders of the step being scheduled (None without offload or when nothing moved)."""
        return self.offload.take_orders() if self.offload is not None else None

    def _release_outside_window(self, request: Request, table: _Table, window: int, ids: list[int]) -> None:
        """Put placeholders where the table's blocks (mirrored in `ids`) lie wholly before the `window` of the
        request's next query (position num_computed_tokens) and drop its references to them, oldest first: at
        ref_cnt 0 a cached one joins the tail of the free queue still cached, evicted before the window's."""
        num_outside = min(self._num_outside(request.num_computed_tokens, window), len(table.blocks))
        start = table.num_null_blocks
        if num_outside <= start:
            return
        released = table.blocks[start:num_outside]
        for i in range(start, num_outside):
            table.blocks[i] = None
            ids[i] = NULL_BLOCK_ID
        table.num_null_blocks = num_outside
        self.pool.free(released)  # type: ignore[arg-type]  # past num_null_blocks every entry is a block

    def cache_computed_blocks(self, request: Request, num_computed: int | None = None) -> None:
        """Register the request's full blocks whose K/V is computed (the first num_computed tokens; default
        all its computed tokens) and whose token ids are known, for reuse."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if table is None:
            return
        num_computed = request.num_computed_tokens if num_computed is None else num_computed
        num_known = request.num_tokens  # a token sampled in flight has no id to hash yet
        if num_computed < num_known:
            num_known = num_computed
        if num_known < (table.num_cached_blocks + 1) * self.block_size:
            return  # no new full block (the common decode step)
        num_full = min(num_known // self.block_size, len(table.blocks))
        if num_full <= table.num_cached_blocks:
            return
        hashes = self._block_hashes(request, num_full * self.block_size)
        for i in range(table.num_cached_blocks, num_full):
            parent = hashes[i - 1] if i else ROOT_PARENT_HASH
            tokens = self._block_tokens(request, i)
            for group, group_table in enumerate((table, *table.extra)):
                block = group_table.blocks[i]
                if block is not None:  # None: released from the window before its step's output came (async)
                    self.pool.cache_block(block, group_block_hash(hashes[i], group), parent, tokens, kv_group=group)
        table.num_cached_blocks = num_full

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """Frees the blocks of the request's table past those holding its first num_tokens tokens (after a
        verification: the blocks only rejected drafts were written to), head of the free queue first (they
        hold nothing reusable). Returns the blocks kept, or None when nothing was freed. Never frees a block
        registered in the prefix cache: those hold known tokens only (cache_computed_blocks)."""
        table = self._tables.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if table is None or len(table.blocks) <= keep:
            return None
        if table.num_cached_blocks > keep:
            raise KVCacheIntegrityError(f"request {request.request_id}: trimming to {keep} blocks would free "
                                        f"{table.num_cached_blocks - keep} cached ones")
        freed: list[KVBlock] = []
        for group_table, ids in zip((table, *table.extra), (request.block_ids, *request.extra_block_ids)):
            freed.extend(b for b in reversed(group_table.blocks[keep:]) if b is not None)
            del group_table.blocks[keep:]
            del ids[keep:]
        self.pool.free(freed)
        return keep

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first, so a sequence's tail is evicted before its head (and
        a prefetch's, for a request that ends while waiting)."""
        if self._prefetches or self._rounds:
            self.release_prefetch(request.request_id)
        table = self._tables.pop(request.request_id, None)
        request.block_ids = []
        request.extra_block_ids = []
        if table is not None:
            self.pool.free(table.all_blocks())

    def check_integrity(self, requests: list[Request] | None = None) -> None:
        """Pool invariants, plus: ref counts equal table references, and given requests mirror their tables."""
        self.pool.check_integrity()
        if self.offload is not None:
            self.offload.check_integrity()
        refs = [0] * self.pool.num_blocks
        for table in [*self._tables.values(), *self._held.values()]:
            for block in table.all_blocks():
                refs[block.block_id] += 1
        for prefetch in self._prefetches.values():
            for block in prefetch.blocks:
                refs[block.block_id] += 1
        for block in self.pool.blocks:
            if block.ref_cnt != refs[block.block_id]:
                raise KVCacheIntegrityError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but {refs[block.block_id]} tables hold it"
                )
        for request in requests or []:
            self._check_table(request, self._tables.get(request.request_id))

    def _check_table(self, request: Request, table: _Table | None) -> None:
        """request.block_ids (and extra_block_ids) mirror its tables (placeholders as NULL_BLOCK_ID), which
        cover its computed tokens and hold placeholders only as a leading run, wholly before the window of its
        next query, all of one length."""
        rid = request.request_id
        tables = [table, *table.extra] if table is not None else [None]
        mirrors = [request.block_ids, *request.extra_block_ids]
        if len(mirrors) != len(tables):
            raise KVCacheIntegrityError(f"request {rid} mirrors {len(mirrors)} block tables, not {len(tables)}")
        if len({len(t.blocks) for t in tables if t is not None}) > 1:
            raise KVCacheIntegrityError(f"request {rid} has block tables of different lengths")
        for group, (ids, group_table, window) in enumerate(zip(mirrors, tables, self.group_windows)):
            self._check_group(request, f"request {rid} group {group}", ids, group_table, window)

    def _check_group(self, request: Request, where: str, ids: list[int], table: _Table | None,
                     window: int | None) -> None:
        blocks = table.blocks if table else []
        expected = [NULL_BLOCK_ID if b is None else b.block_id for b in blocks]
        if ids != expected:
            raise KVCacheIntegrityError(f"{where} block_ids {ids} != its table {expected}")
        if len(ids) * self.block_size < request.num_computed_tokens:
            raise KVCacheIntegrityError(f"{where} has {request.num_computed_tokens} "
                                        f"computed tokens but only {len(ids)} blocks")
        if table is None:
            return
        num_null = sum(1 for b in blocks if b is None)
        if num_null != table.num_null_blocks or any(b is not None for b in blocks[:num_null]):
            raise KVCacheIntegrityError(f"{where} has {num_null} placeholders, not the leading "
                                        f"{table.num_null_blocks} of its table")
        if num_null > self._num_outside(request.num_computed_tokens, window):
            raise KVCacheIntegrityError(f"{where} has a placeholder inside the window of its "
                                        f"{request.num_computed_tokens} computed tokens")

    @property
    def num_tables(self) -> int:
        return len(self._tables)

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(request.all_token_ids[start:start + self.block_size])

    def _block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Chained hashes of (at least) the full blocks within the first num_tokens tokens, memoised on the
        request."""
        hashes = request.block_hashes
        num_full = num_tokens // self.block_size
        parent = hashes[-1] if hashes else ROOT_PARENT_HASH
        for i in range(len(hashes), num_full):
            parent = self.pool.hash_block(parent, self._block_tokens(request, i))
            hashes.append(parent)
        return hashes
