"""Model-free pieces: admission arithmetic, the timing split, error bodies, settings validation, buckets."""

from __future__ import annotations

import pytest

from kvpilot.engine.timeline import RequestMetrics
from kvpilot.server.admission import AdmissionController, QueueLimits
from kvpilot.server.config import ServerArgs, ServerConfigError
from kvpilot.server.openai.errors import APIError, from_value_error
from kvpilot.server.observe.metrics import build_1_2_5_buckets
from kvpilot.server.observe.timings import RequestTimings
from kvpilot.sampling_params import SamplingParams


def test_admission_request_cap_and_release() -> None:
    admission = AdmissionController(QueueLimits(max_num_queued_reqs=2))
    admission.admit("a", 10)
    admission.admit("b", 10)
    with pytest.raises(APIError) as caught:
        admission.admit("c", 1)
    assert caught.value.status == 429 and caught.value.headers["Retry-After"] == "1"
    assert caught.value.code == "queue_full_requests"
    admission.release("a")
    admission.release("a")  # idempotent
    admission.admit("c", 1)
    assert (admission.num_queued_reqs, admission.num_queued_tokens) == (2, 11)


def test_admission_token_cap_lets_one_long_prompt_into_an_empty_queue() -> None:
    admission = AdmissionController(QueueLimits(max_num_queued_tokens=64))
    admission.admit("long", 100)  # alone it may exceed the cap, or it could never run
    with pytest.raises(APIError) as caught:
        admission.admit("next", 1)
    assert caught.value.code == "queue_full_tokens" and "--max-num-queued-tokens" in caught.value.message
    admission.release("long")
    admission.admit("a", 40)
    with pytest.raises(APIError):
        admission.admit("b", 25)
    admission.admit("c", 24)
    assert admission.num_queued_tokens == 64


def _metrics(**overrides: object) -> RequestMetrics:
    values: dict[str, object] = dict(request_id="r", num_prompt_tokens=5, num_generated_tokens=3, num_cached_tokens=0,
                                     num_preemptions=0, finish_reason="length", tokenize_time=0.002, queue_time=0.01,
                                     prefill_time=0.05, ttft=0.07, decode_time=0.2, e2e_latency=0.27,
                                     inter_token_latencies=(0.1, 0.1))
    values.update(overrides)
    return RequestMetrics(**values)  # type: ignore[arg-type]


def test_timings_tile_the_request() -> None:
    t = RequestTimings.build(arrival=100.0, tokenize_s=0.001, metrics=_metrics(), end=100.3)
    assert t.ttft_ms == 70.0 and t.prefill_ms == 50.0 and t.decode_ms == 200.0 and t.e2e_ms == pytest.approx(300.0)
    assert t.tokenize_ms + t.queue_ms + t.prefill_ms == pytest.approx(t.ttft_ms)
    assert t.ttft_ms + t.decode_ms + t.serialize_ms == pytest.approx(t.e2e_ms)
    assert t.server_timing_header().startswith("queue;dur=19.000, tokenize;dur=1.000, prefill;dur=50.000")


def test_timings_without_a_token_count_all_as_queue() -> None:
    t = RequestTimings.build(arrival=0.0, tokenize_s=0.001, metrics=_metrics(ttft=None, prefill_time=None),
                             end=0.5)
    assert t.ttft_ms == 0 and t.queue_ms == pytest.approx(499.0) and t.e2e_ms == 500.0


def test_error_body_is_openai_shaped_and_names_the_field() -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(top_p=2)
    error = from_value_error(caught.value)
    assert error.status == 400 and error.param == "top_p"
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error", "param": "top_p",
                                      "code": 400}}
    assert "SamplingParams." not in error.message


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"max_num_queued_reqs": 0}, "--max-num-queued-reqs"),
    ({"max_num_queued_tokens": -1}, "--max-num-queued-tokens"),
    ({"drain_timeout": -1}, "--drain-timeout"),
    ({"served_model_names": ()}, "--served-model-name"),
])
def test_server_args_name_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ServerConfigError, match=flag):
        ServerArgs(**kwargs)


def test_1_2_5_buckets() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


@pytest.mark.parametrize("chat", [True, False])
def test_a_chunk_is_the_sse_of_head_choices_and_extras_in_order(chat: bool) -> None:
    """ResponseShape.chunk encodes the head once per request and splices it: the text must stay what sse()
    of the whole object gives, non-ASCII, quotes, newlines, surrogate pairs and the final chunk's extras
    included."""
    import json

    from kvpilot.server.openai.responses import ResponseShape, sse

    shape = ResponseShape(chat, 'cmpl-"é', "mödel\n", 1_700_000_000)
    choices = [shape.choice('héllo "q"\n😀', None, None, chunk=True),
               shape.choice("", "stop", {"content": []}, chunk=True, stop_reason=7, index=1)]
    head = {"id": 'cmpl-"é', "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1_700_000_000, "model": "mödel\n"}
    assert shape.chunk(choices) == sse({**head, "choices": choices})
    extras = {"usage": {"prompt_tokens": 3}, "kvpilot": {"ttft_ms": 1.5, "note": "ü"}}
    text = shape.chunk([], **extras)
    assert text == sse({**head, "choices": [], **extras})
    assert json.loads(text.removeprefix("data: ")) == {**head, "choices": [], **extras}
    assert "é" in text and ",\"choices\":" in text  # UTF-8 as is (ensure_ascii off), compact separators


@pytest.mark.parametrize("chat", [True, False])
def test_a_running_chunk_is_the_chunk_of_its_choice(chat: bool) -> None:
    """ResponseShape.running_chunk writes a running stream's chunk from a template: the same text as
    chunk([choice(...)]) for any text and index, with logprobs or without."""
    from kvpilot.server.openai.responses import ResponseShape, sse

    shape = ResponseShape(chat, 'cmpl-"é', "mödel\n", 1_700_000_000)
    for text in ("", " the", 'héllo "q"\n\\😀'):
        for index in (0, 7):
            for logprobs in (None, {"tokens": [text], "token_logprobs": [-0.5]}):
                choice = shape.choice(text, None, logprobs, chunk=True, index=index)
                assert shape.running_chunk(text, logprobs, index) == shape.chunk([choice])
                assert shape.running_chunk(text, logprobs, index).startswith(sse({"id": 'cmpl-"é'})[:12])
