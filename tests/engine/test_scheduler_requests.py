"""Scheduler request lifecycle: token-based stops, finish_requests/abort, add_request validation."""

from __future__ import annotations

import pytest

from kvpilot.engine.request import FinishReason, RequestStatus
from kvpilot.engine.scheduler import Scheduler

from .engine_fakes import FakePagedModel, make_request, make_scheduler, step

EOS = 2


def _feed(sched: Scheduler, token: int):
    """One step in which every request that needs a token samples `token`."""
    out = sched.schedule()
    updates = sched.update_from_output(out, {c.request_id: token for c in out.chunks if c.needs_sample})
    sched.check_integrity()
    return out, updates


def test_eos_stops_with_reason_stop_and_the_token_is_reported() -> None:
    sched = make_scheduler(eos_token_id=EOS)
    r = make_request("r", [1, 2, 3], max_tokens=5, ignore_eos=False)
    sched.add_request(r)
    _feed(sched, 7)
    _, updates = _feed(sched, EOS)
    assert [(u.new_token_ids, u.finish_reason) for u in updates] == [([EOS], FinishReason.STOP)]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.finish_reason is FinishReason.STOP
    assert r.output_token_ids == [7, EOS]
    assert sched.kv.block_counts().num_used == 0


def test_ignore_eos_runs_to_max_tokens() -> None:
    sched = make_scheduler(eos_token_id=EOS)
    r = make_request("r", [1, 2, 3], max_tokens=3, ignore_eos=True)
    sched.add_request(r)
    reasons = [_feed(sched, EOS)[1][0].finish_reason for _ in range(3)]
    assert reasons == [None, None, FinishReason.LENGTH]
    assert r.status is RequestStatus.FINISHED_LENGTH


def test_min_tokens_defers_eos_and_stop_tokens() -> None:
    sched = make_scheduler(eos_token_id=EOS)
    r = make_request("r", [1], max_tokens=6, ignore_eos=False, min_tokens=2, stop_token_ids=[9])
    sched.add_request(r)
    assert _feed(sched, EOS)[1][0].finish_reason is None
    assert _feed(sched, 9)[1][0].finish_reason is FinishReason.STOP  # the 2nd token may stop
    assert r.output_token_ids == [EOS, 9]


def test_stop_token_ids_stop_even_without_an_eos_id() -> None:
    sched = make_scheduler(eos_token_id=None)
    r = make_request("r", [1], max_tokens=6, stop_token_ids=[9, 10])
    sched.add_request(r)
    assert _feed(sched, 10)[1][0].finish_reason is FinishReason.STOP


def test_finish_requests_for_a_stop_string() -> None:
    sched = make_scheduler()
    r = make_request("r", [1, 2], max_tokens=6)
    sched.add_request(r)
    _feed(sched, 5)
    sched.finish_requests(["r"], FinishReason.STOP)
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert sched.schedule().finished_request_ids == ["r"]


def test_abort_frees_blocks_at_once() -> None:
    sched = make_scheduler()
    model = FakePagedModel(4, sched.kv.pool)
    running = make_request("running", list(range(1, 10)), max_tokens=6)
    waiting = make_request("waiting", [1], max_tokens=2)
    sched.add_request(running)
    step(sched, model)
    sched.add_request(waiting)
    assert sched.kv.block_counts().num_used == 3
    sched.abort_requests(["running", "waiting", "unknown"])
    assert sched.kv.block_counts().num_used == 0 and running.block_ids == []
    assert running.status is RequestStatus.FINISHED_ABORTED and running.finish_reason is FinishReason.ABORT
    assert waiting.status is RequestStatus.FINISHED_ABORTED
    assert running.timeline.finished is not None
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.chunks == [] and out.finished_request_ids == ["running", "waiting"]
    sched.check_integrity()


def test_abort_between_schedule_and_update_skips_the_chunk() -> None:
    sched = make_scheduler()
    r = make_request("r", [1, 2, 3], max_tokens=4)
    other = make_request("other", [4, 5], max_tokens=4)
    sched.add_request(r)
    sched.add_request(other)
    out = sched.schedule()
    sched.abort_requests("r")
    updates = sched.update_from_output(out, {"r": 7, "other": 8})
    assert [u.request_id for u in updates] == ["other"]
    assert r.output_token_ids == [] and other.output_token_ids == [8]
    sched.check_integrity()


def test_missing_sampled_token_is_a_clear_error() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("r", [1, 2], max_tokens=4))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token for request 'r'"):
        sched.update_from_output(out, {})


def test_stale_output_is_rejected() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("r", [1, 2], max_tokens=4))
    out = sched.schedule()
    sched.update_from_output(out, {"r": 3})
    with pytest.raises(ValueError, match="stale output"):
        sched.update_from_output(out, {"r": 3})


def test_too_long_for_max_model_len_is_rejected_naming_both_numbers() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_tokens \(8\) = 18 exceeds max_model_len \(16\)"):
        sched.add_request(make_request("r", list(range(10)), max_tokens=8))
    assert not sched.has_unfinished_requests()


def test_request_larger_than_the_whole_cache_is_rejected() -> None:
    sched = make_scheduler(num_blocks=2, max_model_len=64)  # 8 tokens of KV
    with pytest.raises(ValueError, match="needs 3 KV blocks but the whole cache has 2"):
        sched.add_request(make_request("r", list(range(6)), max_tokens=4))
    sched.add_request(make_request("ok", list(range(6)), max_tokens=3))  # 8 tokens, 7 computed: fits


def test_duplicate_and_reused_requests_are_rejected() -> None:
    sched = make_scheduler()
    r = make_request("r", [1], max_tokens=2)
    sched.add_request(r)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("r", [2], max_tokens=2))
    _feed(sched, 3)
    _feed(sched, 3)
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_request(r)


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        make_request("r", [])
