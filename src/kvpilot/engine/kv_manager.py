"""KVCacheManager: block tables of requests over the BlockPool: prefix lookup, allocation, caching, freeing.

The scheduler sees only block ids and token counts; KVBlock objects stay inside this module and the pool.
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
from kvpilot.engine.kv_events import KVEventLog
from kvpilot.engine.request import Request


@dataclass(frozen=True)
class PrefixHit:
    """Result of a prefix-cache lookup: the leading cached blocks and the tokens they cover (a block multiple)."""

    blocks: tuple[KVBlock, ...] = ()
    num_tokens: int = 0
    num_query_tokens: int = 0

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups in tokens, like vLLM's vllm:prefix_cache_queries / _hits counters."""

    num_queries: int = 0
    num_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


@dataclass
class _Table:
    """One request's blocks, and how many leading ones are registered in the prefix cache."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_cached_blocks: int = 0


class KVCacheManager:
    """Owns every request's block table; mirrors the ids into request.block_ids.

    Invariants: each block's ref_cnt equals the number of tables holding it; a table covers at least the
    request's computed tokens; only full blocks whose K/V has been computed are registered for reuse.
    """

    def __init__(self, cache_config: CacheConfig, *, hash_fn: HashFn = chained_block_hash) -> None:
        self.block_size = cache_config.block_size
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        events = KVEventLog(cache_config.block_size) if cache_config.enable_kv_cache_events else None
        self.pool = BlockPool(cache_config.num_blocks, hash_fn=hash_fn, events=events)
        self.prefix_stats = PrefixCacheStats()
        self._tables: dict[str, _Table] = {}

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
        sample, hence at most (num_tokens - 1) // block_size blocks.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return PrefixHit(num_query_tokens=request.num_tokens)
        hashes = self._block_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        parent = ROOT_PARENT_HASH
        for i, block_hash in enumerate(hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, parent, self._block_tokens(request, i))
            if block is None:
                break
            hit.append(block)
            parent = block_hash
        return PrefixHit(tuple(hit), len(hit) * self.block_size, request.num_tokens)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix_hit: PrefixHit | None = None
    ) -> list[int] | None:
        """Grow the table to cover num_computed_tokens (+ the hit) + num_new_tokens; None if blocks run short.

        With prefix_hit (a waiting request being admitted) the hit blocks are shared first, then new blocks
        come from the head of the free queue. On None nothing changed. Returns the ids of the new blocks.
        """
        table = self._tables.get(request.request_id)
        if table is None:
            table = _Table()
        elif prefix_hit is None and \
                request.num_computed_tokens + num_new_tokens <= len(table.blocks) * self.block_size:
            return []  # the common decode step: the last block still has room
        hit = prefix_hit.blocks if prefix_hit is not None else ()
        num_hit_tokens = prefix_hit.num_tokens if prefix_hit is not None else 0
        total_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_new_blocks = max(0, cdiv(total_tokens, self.block_size) - len(table.blocks) - len(hit))
        if num_new_blocks == 0 and prefix_hit is None:
            return []  # the common decode step: the last block still has room
        num_revived = sum(1 for b in hit if b.ref_cnt == 0)  # these leave the free queue when touched
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            return None
        self._tables[request.request_id] = table
        self.pool.touch(hit)
        new_blocks = self.pool.allocate(num_new_blocks)
        table.blocks.extend(hit)
        table.blocks.extend(new_blocks)
        table.num_cached_blocks = max(table.num_cached_blocks, len(hit))
        if prefix_hit is not None and self.enable_prefix_caching:
            self.prefix_stats.num_queries += prefix_hit.num_query_tokens
            self.prefix_stats.num_hits += num_hit_tokens
        new_ids = [b.block_id for b in new_blocks]
        # in place: O(new blocks), not a copy of the whole table every time a decode crosses a block boundary
        request.block_ids.extend(b.block_id for b in hit)
        request.block_ids.extend(new_ids)
        return new_ids

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
            self.pool.cache_block(table.blocks[i], hashes[i], parent, self._block_tokens(request, i))
        table.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first, so a sequence's tail is evicted before its head."""
        table = self._tables.pop(request.request_id, None)
        request.block_ids = []
        if table is not None:
            self.pool.free(table.blocks[::-1])

    def check_integrity(self, requests: list[Request] | None = None) -> None:
        """Pool invariants, plus: ref counts equal table references, and given requests mirror their tables."""
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for table in self._tables.values():
            for block in table.blocks:
                refs[block.block_id] += 1
        for block in self.pool.blocks:
            if block.ref_cnt != refs[block.block_id]:
                raise KVCacheIntegrityError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but {refs[block.block_id]} tables hold it"
                )
        for request in requests or []:
            table = self._tables.get(request.request_id)
            ids = [b.block_id for b in table.blocks] if table else []
            if request.block_ids != ids:
                raise KVCacheIntegrityError(f"request {request.request_id} block_ids {request.block_ids} "
                                            f"!= its table {ids}")
            if len(ids) * self.block_size < request.num_computed_tokens:
                raise KVCacheIntegrityError(f"request {request.request_id} has {request.num_computed_tokens} "
                                            f"computed tokens but only {len(ids)} blocks")

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
