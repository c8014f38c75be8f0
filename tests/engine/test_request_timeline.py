"""Request state and the timeline-derived metrics (queue, prefill, TTFT, decode, inter-token latencies)."""

from __future__ import annotations

import pytest

from kvpilot.engine.request import FinishReason, RequestStatus
from kvpilot.engine.timeline import RequestMetrics, Timeline

from .engine_fakes import FakePagedModel, ManualClock, make_request, make_scheduler, step


def test_status_maps_to_finish_reason() -> None:
    assert RequestStatus.FINISHED_STOPPED.finish_reason is FinishReason.STOP
    assert RequestStatus.FINISHED_LENGTH.finish_reason is FinishReason.LENGTH
    assert RequestStatus.FINISHED_ABORTED.finish_reason is FinishReason.ABORT
    assert RequestStatus.PREEMPTED.finish_reason is None and not RequestStatus.PREEMPTED.is_finished
    assert RequestStatus.finished_with(FinishReason.LENGTH) is RequestStatus.FINISHED_LENGTH
    assert FinishReason.STOP.value == "stop"


def test_tokens_are_tracked() -> None:
    r = make_request("r", [1, 2, 3])
    r.append_output_token(9, now=1.5)
    assert (r.all_token_ids, r.output_token_ids, r.num_tokens) == ([1, 2, 3, 9], [9], 4)
    assert r.timeline.token_times == [1.5]


def test_timeline_is_stamped_at_every_transition() -> None:
    clock = ManualClock(100.0)
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4, clock=clock)
    model = FakePagedModel(4, sched.kv.pool)
    r = make_request("r", list(range(1, 13)), max_tokens=3, arrival_time=99.0)
    r.timeline.tokenized = 99.5
    sched.add_request(r)
    for _ in range(4):  # chunk 8, chunk 4 (+1st token), 2 decodes; each step advances the clock 1 s
        step(sched, model)
    t = r.timeline
    assert (t.arrival, t.tokenized, t.first_scheduled) == (99.0, 99.5, 100.0)
    assert t.token_times == [102.0, 103.0, 104.0] and t.finished == 104.0

    m = r.metrics()
    assert m.queue_time == pytest.approx(0.5) and m.tokenize_time == pytest.approx(0.5)
    assert m.prefill_time == pytest.approx(2.0) and m.ttft == pytest.approx(3.0)
    assert m.decode_time == pytest.approx(2.0) and m.e2e_latency == pytest.approx(5.0)
    assert m.inter_token_latencies == (1.0, 1.0)
    assert (m.num_prompt_tokens, m.num_generated_tokens, m.finish_reason) == (12, 3, "length")
    assert (m.num_cached_tokens, m.num_preemptions) == (0, 0)
    # its prompt's two chunks, by step: what `kvpilot doctor --request` reads (times after arrival in metrics)
    assert t.queued_step == 0
    assert [(c.step_index, c.num_tokens, c.start, c.end) for c in t.prefill_chunks] == [(0, 8, 100.0, 101.0),
                                                                                       (1, 4, 101.0, 102.0)]
    assert [(c.step_index, c.num_tokens, c.start, c.end) for c in m.prefill_chunks] == [(0, 8, 1.0, 2.0),
                                                                                       (1, 4, 2.0, 3.0)]
    assert m.queued_step == 0


def test_a_request_queued_later_counts_the_steps_from_its_arrival_and_shares_them() -> None:
    """b arrives while a's 12-token prompt is prefilled in 4-token chunks: it waits through steps 1-2 (a's
    chunks fill the budget) and is prefilled in step 3; each chunk names its step, so the two can be joined."""
    sched = make_scheduler(max_num_batched_tokens=4, max_num_seqs=4, clock=ManualClock(0.0))
    model = FakePagedModel(4, sched.kv.pool)
    a, b = make_request("a", list(range(1, 13)), max_tokens=2), make_request("b", [7, 8, 9], max_tokens=2)
    sched.add_request(a)
    step(sched, model)
    sched.add_request(b)
    for _ in range(4):
        step(sched, model)
    assert (a.timeline.queued_step, b.timeline.queued_step) == (0, 1)
    assert [(c.step_index, c.num_tokens) for c in a.timeline.prefill_chunks] == [(0, 4), (1, 4), (2, 4)]
    # step 3: a's first decode (1 token) then b's 3-token prompt; a decode is not a prefill chunk
    assert [(c.step_index, c.num_tokens) for c in b.timeline.prefill_chunks] == [(3, 3)]


def test_metrics_of_a_request_aborted_in_the_queue() -> None:
    sched = make_scheduler(clock=ManualClock(5.0))
    r = make_request("r", [1], arrival_time=4.0)
    sched.add_request(r)
    sched.abort_requests("r")
    m = r.metrics()
    assert m.finish_reason == "abort" and m.e2e_latency == pytest.approx(1.0)
    assert m.queue_time is None and m.ttft is None
    assert m.inter_token_latencies == ()


def test_metrics_from_a_bare_timeline() -> None:
    t = Timeline(arrival=0.0, first_scheduled=1.0, token_times=[2.0, 2.5, 4.0], preempted_times=[3.0])
    m = RequestMetrics.from_timeline(t, request_id="x", num_prompt_tokens=5, num_cached_tokens=4,
                                     num_preemptions=1, finish_reason=None)
    assert m.inter_token_latencies == (0.5, 1.5) and m.decode_time == pytest.approx(2.0)
    assert m.queue_time == pytest.approx(1.0) and m.e2e_latency is None
