"""BlockPool: all KV blocks, their ref counts, the LRU free queue and the prefix cache (hash -> block).

Every block is in exactly one state:
  in use   ref_cnt > 0, not in the free queue (held by one or more running requests);
  cached   ref_cnt == 0, has a hash, in the free queue (reusable by a prefix hit, evictable);
  free     ref_cnt == 0, no hash, in the free queue.
Eviction is lazy: a cached block keeps its hash until it is taken from the free queue for new data.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpilot.engine.free_block_queue import FreeBlockQueue
from kvpilot.engine.kv_block import KVBlock
from kvpilot.engine.kv_events import KVEventLog

# Parent hash of a sequence's first block (KV events report it as None).
ROOT_PARENT_HASH = 0x6B7670696C6F74

HashFn = Callable[[int, tuple[int, ...]], int]


def chained_block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """The first 8 bytes of sha256(parent hash, token ids as int64), as an unsigned int: equal hashes mean equal
    prefixes, up to collisions. Stable across processes, restarts and Python versions (Python's own hash()
    is not promised to be), so routers can match the hashes of KV events from any replica."""
    data = parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


class KVCacheIntegrityError(RuntimeError):
    """The block bookkeeping is inconsistent: a kvpilot bug; the message says which invariant broke."""


@dataclass(frozen=True)
class BlockCounts:
    """Blocks by state; num_free + num_cached + num_used == num_total."""

    num_total: int
    num_free: int
    num_cached: int
    num_used: int


class BlockPool:
    """Fixed set of num_blocks blocks, ids 0..num_blocks-1, initially all free in id order.

    Invariants (check_integrity): the free queue holds exactly the blocks with ref_cnt == 0; the hash table
    maps each hash to the one block carrying it, and every hashed block is in the table; ref counts >= 0.
    """

    def __init__(self, num_blocks: int, *, hash_fn: HashFn = chained_block_hash,
                 events: KVEventLog | None = None, on_evict: Callable[[KVBlock], None] | None = None) -> None:
        """`events`, when given, records every block that gains or loses a cached hash (kv_events.py);
        `on_evict` sees each cached block just before its hash is dropped to reuse it (KV offload saves it)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.events = events
        self.on_evict = on_evict
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.hash_fn = hash_fn
        self._cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        # Kept incrementally so stats are O(1) per step; check_integrity recounts them from scratch.
        self._num_used = 0
        self._num_idle_cached = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free plus cached (evicted lazily when taken)."""
        return len(self.free_queue)

    def hash_block(self, parent_hash: int, token_ids: tuple[int, ...]) -> int:
        return self.hash_fn(parent_hash, token_ids)

    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block holding exactly token_ids after parent_hash, or None.

        A hash match alone is not trusted: the stored token ids and parent hash must match too.
        """
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_hash != parent_hash:
            return None
        return block

    def cache_block(self, block: KVBlock, block_hash: int, parent_hash: int, token_ids: tuple[int, ...],
                    kv_group: int = 0) -> bool:
        """Register a full, computed block under block_hash; False (block stays uncached) if the hash is taken.
        A block of KV group > 0 (its hash salted: kv_groups.group_block_hash) is kept out of the KV events.

        A taken hash means another block already holds the same prefix (two requests computed it at once)
        or a true collision; keeping the first holder is correct in both cases.
        """
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        block.kv_group = kv_group
        self._cached[block_hash] = block
        if self.events is not None and not kv_group:
            self.events.stored(block_hash, None if parent_hash == ROOT_PARENT_HASH else parent_hash, token_ids)
        return True

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on each block (prefix hit); a cached block leaves the free queue, keeping its data."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self._num_used += 1
                self._num_idle_cached -= block.block_hash is not None
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take num_blocks blocks from the head of the free queue (LRU first), evicting their cached hashes."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self.free_queue)} are free")
        taken = [self.free_queue.popleft() for _ in range(num_blocks)]
        for block in taken:
            if block.block_hash is not None:
                self._num_idle_cached -= 1
                self._evict(block)
            block.ref_cnt = 1
        self._num_used += num_blocks
        return taken

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each block, in the given order.

        A block whose ref_cnt reaches 0 goes to the free queue: to the tail if it holds cached data (so it is
        evicted last), to the head if it holds nothing reusable (reused first, sparing cached blocks).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise KVCacheIntegrityError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._num_used -= 1
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self._num_idle_cached += 1
                    self.free_queue.append(block)

    def counts(self) -> BlockCounts:
        """Blocks by state, O(1)."""
        return BlockCounts(
            num_total=self.num_blocks,
            num_free=self.num_blocks - self._num_used - self._num_idle_cached,
            num_cached=self._num_idle_cached,
            num_used=self._num_used,
        )

    def recount(self) -> BlockCounts:
        """Blocks by state, counted from scratch (O(num_blocks)): what check_integrity compares with."""
        num_used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        num_cached = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        return BlockCounts(self.num_blocks, self.num_blocks - num_used - num_cached, num_cached, num_used)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(block)
        del self._cached[block.block_hash]
        if self.events is not None and not block.kv_group:
            self.events.removed(block.block_hash)
        block.clear_hash()
        self.num_evictions += 1

    def drop_hash(self, block: KVBlock) -> None:
        """Forgets the block's cached hash without offering it to on_evict (its K/V is not what the hash says:
        a KV offload load that never ran); an idle block stays in the free queue, as free."""
        if block.block_hash is None:
            return
        if block.ref_cnt == 0:
            self._num_idle_cached -= 1
        del self._cached[block.block_hash]
        if self.events is not None and not block.kv_group:
            self.events.removed(block.block_hash)
        block.clear_hash()

    @property
    def cached_hashes(self) -> set[int]:
        """Every hash the prefix cache holds now (blocks in use or idle) for KV group 0: what replaying the KV
        events gives."""
        return {h for h, block in self._cached.items() if not block.kv_group}

    def check_integrity(self) -> None:
        """Raise KVCacheIntegrityError unless free + cached + in use == total and all links/tables agree."""
        queued = list(self.free_queue)
        if len(queued) != len(self.free_queue):
            raise KVCacheIntegrityError(f"free queue length {len(self.free_queue)} but {len(queued)} linked blocks")
        queued_ids = {b.block_id for b in queued}
        if len(queued_ids) != len(queued):
            raise KVCacheIntegrityError("a block appears twice in the free queue")
        for block in self.blocks:
            self._check_block(block, block.block_id in queued_ids)
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise KVCacheIntegrityError(f"hash table entry {block_hash} points at block {block.block_id} "
                                            f"whose hash is {block.block_hash}")
        counts = self.recount()
        if counts != self.counts():
            raise KVCacheIntegrityError(f"block counters {self.counts()} disagree with a recount {counts}")
        if counts.num_free + counts.num_cached + counts.num_used != counts.num_total or counts.num_free < 0:
            raise KVCacheIntegrityError(f"block counts do not add up: {counts}")
        if counts.num_free + counts.num_cached != len(queued):
            raise KVCacheIntegrityError(f"{len(queued)} blocks queued but {counts.num_free} free + "
                                        f"{counts.num_cached} cached")

    def _check_block(self, block: KVBlock, queued: bool) -> None:
        where = f"block {block.block_id}"
        if block.ref_cnt < 0:
            raise KVCacheIntegrityError(f"{where} has negative ref_cnt {block.ref_cnt}")
        if queued != (block.ref_cnt == 0) or queued != block.in_free_queue:
            raise KVCacheIntegrityError(f"{where} ref_cnt {block.ref_cnt} but in free queue: {queued}")
        if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
            raise KVCacheIntegrityError(f"{where} carries hash {block.block_hash} missing from the hash table")
