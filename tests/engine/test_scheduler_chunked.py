"""Scheduler steps: chunk sizes per step, decodes before prefill chunks, limits, chunk contents."""

from __future__ import annotations

from kvpilot.engine.request import FinishReason, RequestStatus

from .engine_fakes import FakePagedModel, block_diff, generate_alone, make_request, make_scheduler, run_to_completion, step


def _shape(output) -> list[tuple[str, int, int, bool]]:
    return [(c.request_id, c.start_position, c.num_tokens, c.needs_sample) for c in output.chunks]


def test_long_prompt_is_chunked_by_the_token_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    model = FakePagedModel(4, sched.kv.pool)
    prompt = list(range(1, 21))
    a = make_request("a", prompt, max_tokens=3)
    sched.add_request(a)

    out, updates = step(sched, model)
    assert _shape(out) == [("a", 0, 8, False)]
    assert block_diff(out) == {"a": [0, 1]} and out.new_requests[0].prompt_token_ids == prompt
    assert updates == [] and a.num_computed_tokens == 8 and a.status is RequestStatus.RUNNING

    out, _ = step(sched, model)
    assert _shape(out) == [("a", 8, 8, False)] and block_diff(out) == {"a": [2, 3]} and not out.new_requests

    out, updates = step(sched, model)
    assert _shape(out) == [("a", 16, 4, True)] and block_diff(out) == {"a": [4]}
    assert [u.new_token_ids for u in updates] == [a.output_token_ids]

    out, _ = step(sched, model)
    assert _shape(out) == [("a", 20, 1, True)] and block_diff(out) == {"a": [5]}
    assert a.block_ids == [0, 1, 2, 3, 4, 5] and model.rows["a"].token_ids[20] == a.output_token_ids[0]

    out, updates = step(sched, model)
    assert _shape(out) == [("a", 21, 1, True)]
    assert updates[0].finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == generate_alone(prompt, 3)
    assert not sched.has_unfinished_requests()


def test_decodes_keep_running_while_a_long_prompt_is_chunked() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    model = FakePagedModel(4, sched.kv.pool)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=10))
    step(sched, model)
    sched.add_request(make_request("b", list(range(30, 50)), max_tokens=2))
    shapes = [_shape(step(sched, model)[0]) for _ in range(3)]
    assert shapes == [
        [("a", 4, 1, True), ("b", 0, 7, False)],
        [("a", 5, 1, True), ("b", 7, 7, False)],
        [("a", 6, 1, True), ("b", 14, 6, True)],
    ]


def test_decodes_go_before_an_older_requests_prefill_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2, policy="priority", num_blocks=10)
    model = FakePagedModel(4, sched.kv.pool)
    sched.add_request(make_request("low", [1, 2, 3, 4], max_tokens=10, priority=1))
    step(sched, model)
    sched.add_request(make_request("high", list(range(20, 32)), max_tokens=2, priority=0))
    assert _shape(step(sched, model)[0]) == [("low", 4, 1, True), ("high", 0, 7, False)]
    # "high" ranks first in the running list, but the decode of "low" still goes before its prefill chunk.
    assert [r.request_id for r in sched._running] == ["high", "low"]
    assert _shape(step(sched, model)[0]) == [("low", 5, 1, True), ("high", 7, 5, True)]


def test_max_num_seqs_caps_running_requests() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=2)
    model = FakePagedModel(4, sched.kv.pool)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [i + 1, i + 2], max_tokens=2))
    out, _ = step(sched, model)
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    out, _ = step(sched, model)
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]  # both finish (max_tokens 2)
    assert out.finished_request_ids == []
    out, _ = step(sched, model)
    assert _shape(out) == [("r2", 0, 2, True)]
    assert out.finished_request_ids == ["r0", "r1"]


def test_every_step_respects_budget_and_seq_limits() -> None:
    sched = make_scheduler(block_size=2, num_blocks=64, max_num_batched_tokens=6, max_num_seqs=3)
    model = FakePagedModel(2, sched.kv.pool)
    prompts = {f"r{i}": [i + 1] * (1 + 3 * i) for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=4))
    requests = {r.request_id: r for r in sched._waiting}
    outputs = run_to_completion(sched, model)
    for out in outputs:
        assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks) <= 6
        assert len(out.chunks) <= 3
    for rid, prompt in prompts.items():
        assert requests[rid].output_token_ids == generate_alone(prompt, 4)
    assert sched.kv.block_counts().num_used == 0
