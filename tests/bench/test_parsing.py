"""SSE parsing, kvpilot server-timing fields and the per-stage join."""

from __future__ import annotations

import dataclasses

import pytest

from kvpilot.bench.breakdown import (parse_kvpilot_field, parse_server_timing_header, stage_breakdown,
                                     timings_from_header)
from kvpilot.bench.client import Target, _delta_text, build_payload
from kvpilot.bench.sse import SseParser

from .test_stats import BASE


def test_sse_parser_handles_split_chunks_and_line_endings() -> None:
    p = SseParser()
    assert p.feed(b"data: {\"a\"") == []
    assert p.feed(b": 1}\r\n\r\n: comment\n\ndata: x\ndata: y\n") == ['{"a": 1}']
    assert p.feed(b"\nevent: ping\n\n") == ["x\ny"]
    assert p.feed(b"data:[DONE]") == []
    assert p.flush() == ["[DONE]"]


KV = {"kvpilot": {"request_id": "r1", "prompt_tokens": 12, "cached_tokens": 8, "num_preemptions": 1,
                  "timings": {"queue_ms": 5, "tokenize_ms": 1, "prefill_ms": 20, "ttft_ms": 26,
                              "decode_ms": 60, "serialize_ms": 2, "e2e_ms": 90}}}


def test_parse_kvpilot_field() -> None:
    t = parse_kvpilot_field(KV)
    assert t is not None and t.request_id == "r1" and t.num_cached_tokens == 8 and t.num_preemptions == 1
    assert (t.queue_ms, t.prefill_ms, t.e2e_ms) == (5.0, 20.0, 90.0)
    assert parse_kvpilot_field({}) is None
    assert parse_kvpilot_field({"kvpilot": {"timings": {"queue_ms": "x"}}}) is None


def test_server_timing_header() -> None:
    h = "queue;dur=1.5, tokenize;dur=0.5, prefill;dur=10, decode;dur=30, serialize;dur=1, cache;desc=hit"
    assert parse_server_timing_header(h) == {"queue": 1.5, "tokenize": 0.5, "prefill": 10.0,
                                             "decode": 30.0, "serialize": 1.0}
    t = timings_from_header(h)
    assert t is not None and t.e2e_ms == pytest.approx(43.0) and t.ttft_ms == pytest.approx(12.0)
    assert timings_from_header(None) is None


def test_stage_breakdown_sums_to_client_e2e() -> None:
    server = parse_kvpilot_field(KV)
    r = dataclasses.replace(BASE, e2e_ms=100.0, server=server)
    stages = stage_breakdown(r)
    assert stages is not None
    assert stages["network"] == pytest.approx(10.0) and stages["other"] == pytest.approx(2.0)
    assert sum(stages.values()) == pytest.approx(100.0)
    assert stage_breakdown(BASE) is None


def test_payloads_follow_the_openai_protocol() -> None:
    t = Target("http://h:1/", "m", "chat", ignore_eos=True)
    body = build_payload(t, "hi", [{"role": "user", "content": "hi"}], 5)
    assert t.url == "http://h:1/v1/chat/completions"
    assert body == {"model": "m", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}],
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
    plain = build_payload(Target("http://h:1", "m", stream=False), "hi", None, 3)
    assert plain == {"model": "m", "max_tokens": 3, "stream": False, "prompt": "hi"}
    greedy = build_payload(Target("http://h:1", "m", stream=False, temperature=0.0), "hi", None, 3)
    assert greedy["temperature"] == 0.0  # --temperature 0: peers compared greedy


def test_output_text_of_chunks() -> None:
    assert _delta_text({"choices": [{"text": "a"}]}) == "a"
    assert _delta_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert _delta_text({"choices": [{"delta": {"reasoning_content": "hmm"}}]}) == "hmm"
    assert _delta_text({"choices": [], "usage": {"completion_tokens": 3}}) is None
