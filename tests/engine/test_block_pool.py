"""BlockPool and FreeBlockQueue: exact block ids, eviction order, hash hits, collisions, integrity."""

from __future__ import annotations

import pytest

from kvpilot.engine.block_pool import ROOT_PARENT_HASH, BlockPool, KVCacheIntegrityError, chained_block_hash
from kvpilot.engine.free_block_queue import FreeBlockQueue
from kvpilot.engine.kv_block import KVBlock


def _cache(pool: BlockPool, block: KVBlock, parent: int, tokens: tuple[int, ...]) -> int:
    block_hash = pool.hash_block(parent, tokens)
    assert pool.cache_block(block, block_hash, parent, tokens)
    return block_hash


def test_free_queue_removes_any_block_and_keeps_order() -> None:
    blocks = [KVBlock(block_id=i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.append(blocks[2])
    queue.appendleft(blocks[0])
    assert queue.block_ids() == [0, 1, 3, 4, 2]
    assert len(queue) == 5
    assert queue.popleft() is blocks[0]
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[0])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[1])


def test_free_queue_popleft_on_empty_raises() -> None:
    queue = FreeBlockQueue([])
    with pytest.raises(IndexError, match="empty"):
        queue.popleft()


def test_allocate_takes_lowest_ids_first_and_counts_states() -> None:
    pool = BlockPool(10)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9]
    counts = pool.counts()
    assert (counts.num_free, counts.num_cached, counts.num_used) == (7, 0, 3)
    with pytest.raises(ValueError, match="only 7 are free"):
        pool.allocate(8)
    pool.check_integrity()


def test_freed_sequence_evicts_tail_blocks_before_head_blocks() -> None:
    pool = BlockPool(10)
    blocks = pool.allocate(3)
    h0 = _cache(pool, blocks[0], ROOT_PARENT_HASH, (1, 2, 3, 4))
    h1 = _cache(pool, blocks[1], h0, (5, 6, 7, 8))
    h2 = _cache(pool, blocks[2], h1, (9, 10, 11, 12))
    pool.free(blocks[::-1])  # how the KV manager frees a request: last block first
    assert pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert pool.counts().num_cached == 3

    assert [b.block_id for b in pool.allocate(7)] == [3, 4, 5, 6, 7, 8, 9]
    assert pool.num_evictions == 0
    (reused,) = pool.allocate(1)
    assert reused.block_id == 2  # the sequence's tail goes first: its head is the likelier shared prefix
    assert reused.block_hash is None and pool.num_evictions == 1
    assert pool.lookup(h2, h1, (9, 10, 11, 12)) is None
    assert pool.lookup(h0, ROOT_PARENT_HASH, (1, 2, 3, 4)) is blocks[0]
    pool.check_integrity()


def test_blocks_without_cached_data_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    _cache(pool, blocks[0], ROOT_PARENT_HASH, (1, 2, 3, 4))
    pool.free(blocks[::-1])  # block 1 holds a partial block: nothing worth keeping
    assert pool.free_queue.block_ids() == [1, 2, 3, 0]
    pool.check_integrity()


def test_touch_revives_a_cached_block_and_shares_refs() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    h = _cache(pool, block, ROOT_PARENT_HASH, (7, 7))
    pool.free([block])
    assert pool.counts().num_cached == 1
    hit = pool.lookup(h, ROOT_PARENT_HASH, (7, 7))
    assert hit is block
    pool.touch([hit, hit])
    assert block.ref_cnt == 2 and block.block_hash == h
    assert pool.free_queue.block_ids() == [1, 2, 3]
    assert pool.counts().num_used == 1
    pool.free([block])
    assert pool.free_queue.block_ids() == [1, 2, 3]  # still held once
    pool.free([block])
    assert pool.free_queue.block_ids() == [1, 2, 3, 0]
    pool.check_integrity()


def test_hash_collision_is_not_a_hit() -> None:
    pool = BlockPool(4, hash_fn=lambda parent, tokens: 42)  # every block collides
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 42, ROOT_PARENT_HASH, (1, 2))
    assert pool.lookup(42, ROOT_PARENT_HASH, (1, 2)) is a
    assert pool.lookup(42, ROOT_PARENT_HASH, (3, 4)) is None  # same hash, other tokens
    assert pool.lookup(42, 42, (1, 2)) is None  # same hash and tokens, other prefix
    assert not pool.cache_block(b, 42, 42, (3, 4))  # hash taken: b stays uncached
    assert b.block_hash is None
    pool.check_integrity()


def test_chained_hash_depends_on_the_parent() -> None:
    h0 = chained_block_hash(ROOT_PARENT_HASH, (1, 2))
    assert chained_block_hash(h0, (3, 4)) != chained_block_hash(ROOT_PARENT_HASH, (3, 4))
    assert chained_block_hash(h0, (3, 4)) == chained_block_hash(h0, (3, 4))


def test_double_free_is_an_integrity_error() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(KVCacheIntegrityError, match="ref_cnt 0"):
        pool.free([block])


def test_integrity_check_catches_corruption() -> None:
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.check_integrity()
    block.ref_cnt = 0  # in use by nobody, yet not in the free queue
    with pytest.raises(KVCacheIntegrityError, match="block 0"):
        pool.check_integrity()
    block.ref_cnt = 1
    block.block_hash = 99  # hash missing from the table
    with pytest.raises(KVCacheIntegrityError, match="hash 99"):
        pool.check_integrity()


def test_integrity_check_catches_counter_drift() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._num_used += 1
    with pytest.raises(KVCacheIntegrityError, match="disagree with a recount"):
        pool.check_integrity()
