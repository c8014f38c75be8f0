"""Sliding-window KV (CacheConfig.sliding_window, every layer sliding): a request's blocks wholly before the
window of its next query go back to the pool and leave NULL_BLOCK_ID placeholders, so long requests hold a
bounded number of blocks, more requests fit the same pool, and preemption, async scheduling and prefix hits
stay exact. The fake model samples from the last W tokens read back through its own block table (stale ids
included), so a block released while still in a window changes the tokens."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine.config import CacheConfig, EngineConfigError, SchedulerConfig, check_model_len_fits
from kvpilot.engine.kv_groups import plan_kv_groups
from kvpilot.engine.kv_manager import NULL_BLOCK_ID
from kvpilot.engine.request import RequestStatus
from kvpilot.engine.scheduler import Scheduler
from kvpilot.fit.kv_cache import KvCapacity, format_capacity_line, window_blocks

from .engine_fakes import (FakePagedModel, add_random_mix, evict_cached, fake_prompt, generate_alone, make_request,
                           make_scheduler, most_running, run_to_completion, step)

BLOCK = 4


def _scheduler(**settings: object) -> Scheduler:
    """make_scheduler with room in max_model_len for requests longer than the pool (a window lets them run)."""
    settings.setdefault("max_model_len", 256)
    return make_scheduler(**settings)  # type: ignore[arg-type]


def _num_null(sched: Scheduler, request_id: str) -> int:
    return sched.kv._tables[request_id].num_null_blocks


def test_a_long_request_holds_a_bounded_number_of_blocks() -> None:
    window, budget = 8, 8
    # 10 blocks hold 40 tokens; the request has 69 of KV: only a window lets it run at all
    sched = _scheduler(num_blocks=10, max_num_batched_tokens=budget, sliding_window=window)
    model = FakePagedModel(BLOCK, sched.kv.pool, window=window)
    prompt = fake_prompt(1, 40)
    request = make_request("long", prompt, max_tokens=30)
    sched.add_request(request)
    bound_prefill = -(-(window - 1 + budget) // BLOCK) + 1
    most_null = 0
    while sched.has_unfinished_requests():
        step(sched, model)  # checks every invariant, placeholders only before the window included
        if request.status is RequestStatus.RUNNING:
            num_null = _num_null(sched, "long")
            live = len(request.block_ids) - num_null
            assert live == sched.kv.pool.counts().num_used <= bound_prefill
            if request.num_computed_tokens > len(prompt):  # decoding: the window's blocks only
                assert live <= window_blocks(window, BLOCK) == 3
            assert request.block_ids[:num_null] == [NULL_BLOCK_ID] * num_null
            most_null = max(most_null, num_null)
    assert most_null == (40 + 29 - window) // BLOCK - 1  # every block but the window's, at the end
    assert request.output_token_ids == generate_alone(prompt, 30, window)
    assert sched.kv.pool.counts().num_used == 0


def test_the_same_request_is_refused_without_a_window() -> None:
    sched = _scheduler(num_blocks=10, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="KV blocks but the whole cache has 10"):
        sched.add_request(make_request("long", fake_prompt(1, 40), max_tokens=30))


def test_released_blocks_are_reused_by_another_request() -> None:
    sched = _scheduler(num_blocks=6, max_num_batched_tokens=8, sliding_window=4, enable_prefix_caching=False)
    model = FakePagedModel(BLOCK, sched.kv.pool, window=4)
    a = make_request("a", fake_prompt(2, 16), max_tokens=12)
    sched.add_request(a)
    held: set[int] = set()
    for _ in range(3):  # two chunks of 8, then a decode: blocks 0..2 fall out of a's window
        step(sched, model)
        held |= set(a.block_ids[_num_null(sched, "a"):])
    released = held - set(a.block_ids[_num_null(sched, "a"):])  # (a reused one itself: block 0 for 8..11)
    assert _num_null(sched, "a") == 3 and len(a.block_ids) - 3 == 2 and released
    b = make_request("b", fake_prompt(3, 12), max_tokens=4)
    sched.add_request(b)
    step(sched, model)
    assert b.status is RequestStatus.RUNNING and set(b.block_ids) & released  # a's old blocks, now b's
    run_to_completion(sched, model)
    assert a.output_token_ids == generate_alone(fake_prompt(2, 16), 12, 4)
    assert b.output_token_ids == generate_alone(fake_prompt(3, 12), 4, 4)


def _most_running(window: int | None) -> tuple[int, int]:
    """(most requests running at once, preemptions) for 4 requests of 16 + 16 tokens on 12 blocks of 4."""
    sched = _scheduler(num_blocks=12, max_num_batched_tokens=16, sliding_window=window)
    model = FakePagedModel(BLOCK, sched.kv.pool, window=window)
    requests = [make_request(f"r{i}", fake_prompt(10 + i, 16), max_tokens=16) for i in range(4)]
    counts = most_running(sched, model, requests)
    for i, request in enumerate(requests):
        assert request.output_token_ids == generate_alone(fake_prompt(10 + i, 16), 16, window)
    return counts


def test_more_requests_run_at_once_than_without_the_window() -> None:
    windowed, unwindowed = _most_running(4), _most_running(None)
    assert windowed == (4, 0)
    assert unwindowed[0] < 4 and unwindowed[1] > 0  # the same pool: a full-attention model must preempt


def test_preemption_and_resume_under_a_window_are_exact() -> None:
    window = 6
    sched = _scheduler(num_blocks=9, max_num_batched_tokens=8, sliding_window=window)
    model = FakePagedModel(BLOCK, sched.kv.pool, window=window)
    prompts = [fake_prompt(20 + i, 10 + 3 * i) for i in range(5)]
    requests = [make_request(f"p{i}", p, max_tokens=20) for i, p in enumerate(prompts)]
    for request in requests:
        sched.add_request(request)
    run_to_completion(sched, model)
    assert sched.num_preemptions > 0
    assert any(r.num_preemptions for r in requests)
    for prompt, request in zip(prompts, requests):
        assert request.output_token_ids == generate_alone(prompt, 20, window)
    counts = sched.kv.pool.counts()
    assert counts.num_used == 0 and counts.num_free + counts.num_cached == 9


@pytest.mark.parametrize("pipelined", [False, True])
def test_random_mixes_stay_exact(pipelined: bool) -> None:
    rng = random.Random(7 + pipelined)
    for trial in range(6):
        window = rng.choice([1, 3, 4, 5, 9])
        budget = rng.choice([4, 8, 16])
        sched = _scheduler(num_blocks=rng.choice([8, 10, 14]), max_num_batched_tokens=budget,
                               max_num_seqs=4, sliding_window=window)
        model = FakePagedModel(BLOCK, sched.kv.pool, window=window)
        cases = add_random_mix(sched, rng, trial)
        run_to_completion(sched, model, pipelined=pipelined)
        for request, prompt in cases:
            assert request.output_token_ids == generate_alone(prompt, request.max_tokens, window), \
                f"trial {trial} window {window} budget {budget}: {request.request_id}"


def test_a_prefix_hit_needs_only_the_blocks_in_the_window() -> None:
    window = 6  # the first new token at position p reads keys p-5..p
    sched = _scheduler(num_blocks=12, max_num_batched_tokens=32, sliding_window=window)
    model = FakePagedModel(BLOCK, sched.kv.pool, window=window)
    prompt = fake_prompt(40, 24)  # 6 full blocks
    first = make_request("first", prompt + [91], max_tokens=2)
    sched.add_request(first)
    run_to_completion(sched, model)
    pool = sched.kv.pool
    hashes = first.block_hashes[:6]
    evict_cached(pool, hashes[:3])  # the prompt's first 3 blocks leave the cache
    assert [h in pool.cached_hashes for h in hashes] == [False, False, False, True, True, True]

    second = make_request("second", prompt + [92, 93], max_tokens=3)
    hit = sched.kv.get_computed_blocks(second)
    # 6 blocks: position 24 reads 19..24, i.e. blocks 4 and 5 (and its own); blocks 0..3 are placeholders
    assert hit.num_tokens == 24 and hit.blocks[:4] == (None,) * 4 and None not in hit.blocks[4:]
    assert hit.block_ids[:4] == [NULL_BLOCK_ID] * 4
    sched.add_request(second)
    out, _ = step(sched, model)
    (new,) = out.new_requests
    assert new.num_computed_tokens == 24 and new.block_ids[:4] == [NULL_BLOCK_ID] * 4
    assert second.num_cached_tokens == 24
    run_to_completion(sched, model)
    assert second.output_token_ids == generate_alone(prompt + [92, 93], 3, window)


def test_a_hit_stops_where_a_block_of_its_window_is_missing() -> None:
    window = 6
    sched = _scheduler(num_blocks=12, max_num_batched_tokens=32, sliding_window=window)
    model = FakePagedModel(BLOCK, sched.kv.pool, window=window)
    prompt = fake_prompt(41, 24)
    sched.add_request(make_request("first", prompt + [91], max_tokens=1))
    run_to_completion(sched, model)
    pool = sched.kv.pool
    hashes = sched.kv._block_hashes(make_request("probe", prompt + [91]), 24)
    evict_cached(pool, [hashes[4]])  # block 4 is in the window of positions 20..24
    second = make_request("second", prompt + [92], max_tokens=2)
    hit = sched.kv.get_computed_blocks(second)
    # 6 blocks would need block 4; 5 blocks (position 20 reads 15..20: blocks 3 and 4) too; 4 blocks need
    # blocks 2 and 3, which are cached
    assert hit.num_tokens == 16 and None not in hit.blocks[2:] and len(hit.blocks) == 4
    sched.add_request(second)
    run_to_completion(sched, model)
    assert second.output_token_ids == generate_alone(prompt + [92], 2, window)


def test_admission_counts_only_the_blocks_a_windowed_request_holds() -> None:
    cache = CacheConfig(num_blocks=6, block_size=4, sliding_window=8)
    assert cache.max_blocks_per_request(1000, 8) == -(-(8 - 1 + 8) // 4) + 1 == 5
    assert cache.max_blocks_per_request(10, 8) == 3  # a short request: all its tokens
    assert CacheConfig(num_blocks=6, block_size=4).max_blocks_per_request(1000, 8) == 250
    check_model_len_fits(SchedulerConfig(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=8), cache)
    with pytest.raises(EngineConfigError, match="does not fit"):
        check_model_len_fits(SchedulerConfig(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=64), cache)
    with pytest.raises(EngineConfigError, match="sliding_window"):
        CacheConfig(num_blocks=6, sliding_window=0)


def test_one_group_gets_a_window_only_when_every_layer_slides() -> None:
    def one_group(windows):
        return plan_kv_groups(windows, hybrid=False).group_windows

    assert plan_kv_groups([4096] * 32).group_windows == (4096,)  # Mistral v0.1, Mixtral: one group
    assert one_group([512, None] * 14) == (None,)  # Gemma-style interleave in one group: full layers read all
    assert one_group([None] * 4) == (None,) and one_group([]) == (None,)
    assert one_group([128, 256]) == (256,)  # the largest window is safe for every layer


def test_fit_capacity_follows_the_window() -> None:
    capacity = KvCapacity(num_blocks=1000, block_size=16, bytes_per_block=1, max_model_len=32768, sliding_window=4096)
    assert window_blocks(4096, 16) == 257
    assert capacity.max_concurrency == pytest.approx(1000 / 257)
    assert KvCapacity(1000, 16, 1, 32768).max_concurrency == pytest.approx(1000 / 2048)
    assert "tokens per request (sliding window of 4,096): 3.89x" in format_capacity_line(capacity)
