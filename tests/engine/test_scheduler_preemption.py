"""Preemption: exact victims, freed blocks, recompute on resume, counts, and no failure under KV pressure."""

from __future__ import annotations

from kvpilot.engine.request import RequestStatus

from .engine_fakes import (FakePagedModel, block_diff, generate_alone, make_request, make_scheduler, run_to_completion,
                           step)

A_PROMPT = [1, 2, 3, 4]
B_PROMPT = [5, 6, 7, 8]


def test_newest_request_is_preempted_and_recomputed() -> None:
    # 4 blocks of 4 tokens; two requests of 4 + 8 tokens each need 3 blocks: they cannot both finish.
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=16, max_num_seqs=4)
    model = FakePagedModel(4, sched.kv.pool)
    a = make_request("a", A_PROMPT, max_tokens=8)
    b = make_request("b", B_PROMPT, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)

    out, _ = step(sched, model)
    assert block_diff(out) == {"a": [0], "b": [1]}
    stats = sched.make_stats()
    assert (stats.kv_cache_usage, stats.num_running, stats.num_used_blocks, stats.num_free_blocks) == (0.5, 2, 2, 2)
    for _ in range(4):  # decodes at positions 4..7 fill one more block each
        out, _ = step(sched, model)
    assert (a.block_ids, b.block_ids) == ([0, 2], [1, 3])
    assert sched.kv.num_free_blocks == 0

    out, _ = step(sched, model)  # a needs a block for position 8: b, the newest, is preempted
    assert out.preempted_request_ids == ["b"]
    assert [(c.request_id, c.start_position) for c in out.chunks] == [("a", 8)]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.block_ids == [] and len(b.output_token_ids) == 5
    assert a.block_ids == [0, 2, 3]  # b's blocks went back tail first: block 3, then block 1
    assert sched.num_waiting == 1 and sched.make_stats().num_preemptions == 1

    out, _ = step(sched, model)  # b does not fit yet (needs 3 blocks, 1 free): it waits, a goes on
    assert [c.request_id for c in out.chunks] == ["a"] and out.preempted_request_ids == []
    out, updates = step(sched, model)
    assert updates[0].finished and a.output_token_ids == generate_alone(A_PROMPT, 8)

    out, _ = step(sched, model)  # b resumes: its prompt block is still cached; the rest is recomputed
    (chunk,) = out.chunks
    assert (chunk.request_id, chunk.start_position, chunk.num_tokens) == ("b", 4, 5)
    (resumed,) = out.new_requests  # the runner gets its whole state again, outputs so far included
    assert resumed.output_token_ids == b.output_token_ids[:5] and resumed.num_computed_tokens == 4
    assert b.block_ids == [1, 3, 2]
    assert b.num_cached_tokens == 0  # the hit at first admission, not the recompute
    assert b.timeline.resumed_times and len(b.timeline.preempted_times) == 1
    # its prompt's chunk, then the recompute of 5 tokens when it resumed (step 8)
    assert [(c.step_index, c.num_tokens) for c in b.timeline.prefill_chunks] == [(0, 4), (8, 5)]
    assert [(c.step_index, c.num_tokens) for c in a.timeline.prefill_chunks] == [(0, 4)]
    run_to_completion(sched, model)
    assert b.output_token_ids == generate_alone(B_PROMPT, 8)
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4 + 4 + 9, 4)
    assert (stats.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)


def test_priority_policy_preempts_the_lowest_priority_even_if_older() -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=16, policy="priority")
    model = FakePagedModel(4, sched.kv.pool)
    low = make_request("low", B_PROMPT, max_tokens=8, priority=5)
    high = make_request("high", A_PROMPT, max_tokens=8, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    preempted = [rid for out in run_to_completion(sched, model) for rid in out.preempted_request_ids]
    assert preempted == ["low"]
    assert (low.num_preemptions, high.num_preemptions) == (1, 0)
    assert high.timeline.finished < low.timeline.finished
    assert low.output_token_ids == generate_alone(B_PROMPT, 8)


def test_victim_already_scheduled_this_step_gives_its_budget_back() -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=16,
                           policy="priority")
    model = FakePagedModel(4, sched.kv.pool)
    low = make_request("low", [1, 2, 3, 4], max_tokens=10, priority=1)
    sched.add_request(low)
    step(sched, model)
    high = make_request("high", list(range(20, 32)), max_tokens=2, priority=0)
    sched.add_request(high)
    out, _ = step(sched, model)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("low", 1), ("high", 7)]
    assert (low.block_ids, high.block_ids) == ([0, 1], [2, 3])

    out, _ = step(sched, model)  # low's decode was scheduled first, then dropped to make room for high
    assert out.preempted_request_ids == ["low"]
    assert [(c.request_id, c.start_position, c.num_tokens) for c in out.chunks] == [("high", 7, 5)]
    assert out.num_batched_tokens == 5
    assert high.block_ids == [2, 3, 1]  # low's partial block 1 is reused before its cached block 0
    run_to_completion(sched, model)
    assert low.output_token_ids == generate_alone([1, 2, 3, 4], 10)
    assert high.output_token_ids == generate_alone(list(range(20, 32)), 2)


def test_many_requests_on_a_tiny_cache_all_finish_correctly() -> None:
    sched = make_scheduler(block_size=2, num_blocks=12, max_num_batched_tokens=10, max_num_seqs=6)
    model = FakePagedModel(2, sched.kv.pool)
    prompts = {f"r{i}": [10 + i] * (2 + i) for i in range(10)}
    requests = [make_request(rid, p, max_tokens=12) for rid, p in prompts.items()]
    for r in requests:
        sched.add_request(r)
    run_to_completion(sched, model)
    assert sched.num_preemptions > 0
    assert sum(r.num_preemptions for r in requests) == sched.num_preemptions
    for r in requests:
        assert r.output_token_ids == generate_alone(prompts[r.request_id], 12)
        assert r.status is RequestStatus.FINISHED_LENGTH
    counts = sched.kv.block_counts()
    assert counts.num_used == 0 and counts.num_free + counts.num_cached == 12
