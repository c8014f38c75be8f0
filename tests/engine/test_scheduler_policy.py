"""Scheduling policies: fcfs admits in arrival order, priority admits lower integers first (ties by arrival)."""

from __future__ import annotations

import pytest

from kvpilot.engine.request_queue import make_request_queue

from .engine_fakes import FakePagedModel, make_request, make_scheduler, run_to_completion


def _admission_order(policy: str, priorities: dict[str, int]) -> list[str]:
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8, policy=policy)
    model = FakePagedModel(4, sched.kv.pool)
    for rid, priority in priorities.items():
        sched.add_request(make_request(rid, [1, 2], max_tokens=1, priority=priority))
    outputs = run_to_completion(sched, model)
    return [c.request_id for out in outputs for c in out.chunks]


def test_fcfs_ignores_priority() -> None:
    assert _admission_order("fcfs", {"a": 3, "b": 0, "c": 1}) == ["a", "b", "c"]


def test_priority_admits_lowest_first_ties_by_arrival() -> None:
    order = _admission_order("priority", {"a": 3, "b": 0, "c": 1, "d": 0, "e": -2})
    assert order == ["e", "b", "d", "c", "a"]


def test_head_of_line_request_is_not_overtaken_when_it_does_not_fit() -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=32, max_model_len=16)
    sched.add_request(make_request("big1", list(range(8)), max_tokens=4))
    sched.add_request(make_request("big2", list(range(20, 32)), max_tokens=4))  # 3 blocks, 2 left
    sched.add_request(make_request("small", [1], max_tokens=1))  # 1 block would fit
    first = sched.schedule()
    # "small" waits behind "big2" instead of jumping it: overtaking could starve big requests forever
    assert [c.request_id for c in first.chunks] == ["big1"]
    assert [r.request_id for r in sched._waiting] == ["big2", "small"]


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="fcfs"):
        make_request_queue("lifo")


def test_priority_queue_remove_and_requeue_keep_order() -> None:
    queue = make_request_queue("priority")
    reqs = {rid: make_request(rid, [1], priority=p) for rid, p in (("a", 2), ("b", 1), ("c", 1))}
    for order, r in enumerate(reqs.values()):
        queue.add(r, order)
    assert [r.request_id for r in queue] == ["b", "c", "a"]
    queue.remove(reqs["c"])
    assert queue.pop() is reqs["b"]
    queue.push_front(reqs["b"], 1)  # a preempted request goes back to its place, not behind later arrivals
    assert [r.request_id for r in queue] == ["b", "a"] and len(queue) == 2


def test_fcfs_queue_puts_preempted_requests_first() -> None:
    queue = make_request_queue("fcfs")
    first, second = make_request("first", [1]), make_request("second", [1])
    queue.add(second, 1)
    queue.push_front(first, 0)
    assert queue.peek() is first and [r.request_id for r in queue] == ["first", "second"]
