"""Prefix caching through the scheduler: skipped tokens, shared block ids, hit counters, exact outputs."""

from __future__ import annotations

from .engine_fakes import FakePagedModel, generate_alone, make_request, make_scheduler, run_to_completion, step

SHARED = list(range(1, 9))  # two full blocks of 4


def test_second_wave_skips_the_shared_prefix() -> None:
    sched = make_scheduler(num_blocks=16)
    model = FakePagedModel(4, sched.kv.pool)
    first = make_request("first", SHARED + [50, 51], max_tokens=3)
    sched.add_request(first)
    out, _ = step(sched, model)
    shared_blocks = first.block_ids[:2]
    assert shared_blocks == [0, 1]
    run_to_completion(sched, model)

    second = make_request("second", SHARED + [60, 61, 62], max_tokens=3)
    sched.add_request(second)
    out, _ = step(sched, model)
    (chunk,) = out.chunks
    assert (chunk.start_position, chunk.num_tokens) == (8, 3)
    assert second.block_ids[:2] == shared_blocks
    assert second.num_cached_tokens == 8
    run_to_completion(sched, model)
    assert second.output_token_ids == generate_alone(SHARED + [60, 61, 62], 3)
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)
    assert 0 < stats.prefix_cache_hit_rate < 1


def test_concurrent_requests_share_blocks_computed_in_an_earlier_step() -> None:
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    model = FakePagedModel(4, sched.kv.pool)
    a = make_request("a", SHARED + [70], max_tokens=4)
    b = make_request("b", SHARED + [80], max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, model)  # a's first 8 tokens use the whole budget
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 8)]
    out, _ = step(sched, model)  # b arrives at the shared blocks after they were computed
    assert [(c.request_id, c.start_position, c.num_tokens) for c in out.chunks] == [("a", 8, 1), ("b", 8, 1)]
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_cached_tokens == 8
    run_to_completion(sched, model)
    assert a.output_token_ids == generate_alone(SHARED + [70], 4)
    assert b.output_token_ids == generate_alone(SHARED + [80], 4)


def test_blocks_being_computed_in_the_same_step_are_not_hits() -> None:
    sched = make_scheduler(num_blocks=16)
    model = FakePagedModel(4, sched.kv.pool)
    sched.add_request(make_request("a", SHARED + [1], max_tokens=2))
    b = make_request("b", SHARED + [2], max_tokens=2)
    sched.add_request(b)
    out, _ = step(sched, model)
    assert [c.start_position for c in out.chunks] == [0, 0]
    assert b.num_cached_tokens == 0
    run_to_completion(sched, model)
    # the shared prefix was computed twice: the second copy stays uncached, and nothing leaks
    counts = sched.kv.block_counts()
    assert counts.num_used == 0 and counts.num_total == 16


def test_disabled_prefix_caching_recomputes_everything() -> None:
    sched = make_scheduler(num_blocks=16, enable_prefix_caching=False)
    model = FakePagedModel(4, sched.kv.pool)
    sched.add_request(make_request("a", SHARED + [1], max_tokens=2))
    run_to_completion(sched, model)
    b = make_request("b", SHARED + [2], max_tokens=2)
    sched.add_request(b)
    out, _ = step(sched, model)
    assert out.chunks[0].start_position == 0 and b.num_cached_tokens == 0
    assert sched.make_stats().prefix_cache_queries == 0


def test_blocks_of_a_request_finishing_in_its_prefill_step_are_cached() -> None:
    """The step's full blocks are registered before its finishing token frees them (max_tokens=1)."""
    sched = make_scheduler(num_blocks=16)
    model = FakePagedModel(4, sched.kv.pool)
    first = make_request("first", SHARED + [60], max_tokens=1)
    sched.add_request(first)
    _, updates = step(sched, model)
    assert updates[0].finished
    again = make_request("again", SHARED + [61], max_tokens=1)
    sched.add_request(again)
    step(sched, model)
    assert again.num_cached_tokens == 8
