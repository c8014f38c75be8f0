"""KVCacheManager: block tables, prefix hits (exact block ids), caching of computed blocks, freeing order."""

from __future__ import annotations

import pytest

from kvpilot.engine.block_pool import KVCacheIntegrityError
from kvpilot.engine.config import CacheConfig
from kvpilot.engine.kv_manager import KVCacheManager
from kvpilot.engine.request import Request

from .engine_fakes import make_request

PROMPT = list(range(1, 11))  # 10 tokens: 2 full blocks of 4 + 2


def _manager(num_blocks: int = 10, prefix: bool = True) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=prefix))


def _compute_all(kv: KVCacheManager, request: Request) -> None:
    """Admit the request's whole context and mark it computed, as one prefill step would."""
    hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - hit.num_tokens, hit) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)


def test_allocate_mirrors_block_ids_into_the_request() -> None:
    kv = _manager()
    a = make_request("a", PROMPT)
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    assert a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) == []  # 12 tokens still fit in 3 blocks
    assert kv.allocate_slots(a, 3) == [3]
    kv.check_integrity([a])


def test_prefix_hit_shares_full_blocks_only() -> None:
    kv = _manager()
    a = make_request("a", PROMPT)
    _compute_all(kv, a)
    b = make_request("b", PROMPT[:8] + [99, 98, 97])
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [0, 1] and hit.num_tokens == 8
    assert kv.allocate_slots(b, 3, hit) == [3]
    assert b.block_ids == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert (kv.prefix_stats.num_queries, kv.prefix_stats.num_hits) == (10 + 11, 8)
    kv.check_integrity([a, b])


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    kv = _manager()
    _compute_all(kv, make_request("a", PROMPT))
    same = make_request("same", PROMPT)
    assert kv.get_computed_blocks(same).num_tokens == 8  # (10 - 1) // 4 = 2 blocks
    aligned = make_request("aligned", PROMPT[:8])
    hit = kv.get_computed_blocks(aligned)
    assert hit.block_ids == [0] and hit.num_tokens == 4  # block 1 would leave nothing to compute


def test_partial_and_uncomputed_blocks_are_not_cached() -> None:
    kv = _manager()
    a = make_request("a", PROMPT)
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 6  # a chunk of 6: only block 0 is full and computed
    kv.cache_computed_blocks(a)
    assert [kv.pool.blocks[i].block_hash is not None for i in range(3)] == [True, False, False]
    b = make_request("b", PROMPT)
    assert kv.get_computed_blocks(b).block_ids == [0]


def test_blocks_filled_by_decoding_become_cacheable() -> None:
    kv = _manager()
    a = make_request("a", [1, 2, 3])
    _compute_all(kv, a)
    assert kv.pool.blocks[0].block_hash is None
    for token, now in ((50, 1.0), (51, 2.0)):
        a.append_output_token(token, now)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        kv.cache_computed_blocks(a)
    assert kv.pool.blocks[0].token_ids == (1, 2, 3, 50)
    follower = make_request("f", [1, 2, 3, 50, 7])
    assert kv.get_computed_blocks(follower).block_ids == [0]


def test_free_releases_tail_first_and_keeps_cached_blocks_for_reuse() -> None:
    kv = _manager(num_blocks=4)
    a = make_request("a", PROMPT)
    _compute_all(kv, a)
    kv.free(a)
    assert a.block_ids == []
    # block 2 (partial) is reused first; cached blocks 1 then 0 follow: the tail is evicted before the head.
    assert kv.pool.free_queue.block_ids() == [2, 3, 1, 0]
    b = make_request("b", PROMPT)
    hit = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 2, hit) == [2]
    assert b.block_ids == [0, 1, 2]
    kv.check_integrity([b])


def test_allocation_failure_changes_nothing() -> None:
    kv = _manager(num_blocks=3)
    a = make_request("a", PROMPT)
    _compute_all(kv, a)
    kv.free(a)
    b = make_request("b", PROMPT[:8] + [5] * 6)  # hit of 2 blocks + needs 2 new: only 1 left
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, 6, hit) is None
    assert b.block_ids == [] and kv.num_tables == 0
    assert kv.pool.free_queue.block_ids() == [2, 1, 0]
    assert kv.prefix_stats.num_queries == 10  # the failed admission is not counted
    kv.check_integrity([b])


def test_prefix_caching_disabled_never_hits() -> None:
    kv = _manager(prefix=False)
    a = make_request("a", PROMPT)
    _compute_all(kv, a)
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.get_computed_blocks(make_request("b", PROMPT)).num_tokens == 0
    assert kv.prefix_stats.num_queries == 0


def test_usage_counts_blocks_in_use_only() -> None:
    kv = _manager(num_blocks=4)
    a = make_request("a", PROMPT)
    _compute_all(kv, a)
    assert kv.usage == pytest.approx(0.75)
    kv.free(a)
    assert kv.usage == 0.0
    assert kv.block_counts().num_cached == 2


def test_integrity_catches_a_request_out_of_sync() -> None:
    kv = _manager()
    a = make_request("a", PROMPT)
    kv.allocate_slots(a, 10)
    a.block_ids = [0, 1]
    with pytest.raises(KVCacheIntegrityError, match="block_ids"):
        kv.check_integrity([a])
    a.block_ids = [0, 1, 2]
    kv.pool.blocks[1].ref_cnt = 2
    with pytest.raises(KVCacheIntegrityError, match="1 tables hold it"):
        kv.check_integrity([a])


def test_colliding_hashes_do_not_share_blocks() -> None:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=10), hash_fn=lambda parent, tokens: 7)
    a = make_request("a", PROMPT)
    _compute_all(kv, a)
    assert kv.get_computed_blocks(make_request("b", [9, 9, 9, 9, 9])).num_tokens == 0
    same_first_block = make_request("c", PROMPT[:4] + [0, 0, 0, 0, 1])
    assert kv.get_computed_blocks(same_first_block).block_ids == [0]  # block 1 collides but differs
