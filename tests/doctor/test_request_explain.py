"""Issue #51 item 4: `kvpilot doctor --request ID` explains one slow request from the server's ring of recent
request timelines (GET /v1/kvpilot/requests/{id}, behind the API key), naming the requests it waited behind.

The live test stages head-of-line blocking on the real server: a short prompt sent while a long one is being
prefilled waits for that step, and the doctor names the long prompt's request by its id."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from kvpilot.doctor.errors import DoctorInputError
from kvpilot.doctor.render_html import slowest_html
from kvpilot.doctor.request_explain import client_lines, explain, explain_slowest, fetch_timelines, slowest_records
from kvpilot.engine.timeline import RequestMetrics
from kvpilot.server.observe.request_timelines import RequestTimeline, TimelineRing, longest_gaps
from tests.doctor.live_staging import MODEL, kvpilot_server

KEY = "doctor-test-key"


def _timeline(rid: str, arrival: float, prompt: int, queue: float, prefill: float, decode: float,
              preempt: int = 0, cached: int = 0) -> dict[str, Any]:
    ttft = 1.0 + queue + prefill
    timings = {"tokenize_ms": 1.0, "queue_ms": queue, "prefill_ms": prefill, "ttft_ms": ttft, "decode_ms": decode,
               "serialize_ms": 0.5, "e2e_ms": ttft + decode + 0.5}
    return RequestTimeline(rid, "/v1/completions", 200, arrival, prompt, cached, preempt, 8, timings).to_json()


def test_a_short_request_behind_a_long_prefill_names_it_first() -> None:
    """Request s arrives 0.1 s into l's 1.5 s prefill of 8,000 tokens; a short neighbour c prefilled in 20 ms."""
    doc = {"request": _timeline("s", 100.1, 20, queue=1400.0, prefill=30.0, decode=70.0, cached=0),
           "overlapping": [_timeline("l", 100.0, 8000, queue=0.0, prefill=1500.0, decode=200.0),
                           _timeline("c", 101.45, 30, queue=0.0, prefill=20.0, decode=80.0)]}
    e = explain(doc)
    assert e.slowest_stage == "queue" and [b.request_id for b in e.blockers][:1] == ["l"]
    assert e.blockers[0].overlap_ms == pytest.approx(1400.0, abs=2.0) and e.ran_alongside == 2
    assert any("waited behind request l: its 8,000-token prompt" in line for line in e.lines)


def test_preemptions_and_cache_are_reported() -> None:
    e = explain({"request": _timeline("p", 5.0, 600, queue=5.0, prefill=300.0, decode=900.0, preempt=2,
                                      cached=512), "overlapping": []})
    assert e.slowest_stage == "decode" and not e.blockers
    assert any("preempted 2 time(s)" in line for line in e.lines)
    assert any("served 512 of its 600" in line for line in e.lines)


def _chunks(*steps: tuple[int, int, float, float]) -> tuple[dict[str, float], ...]:
    """(step, tokens, start ms, end ms after the request's arrival) as the route records them."""
    return tuple({"step": st, "num_tokens": n, "start_ms": a, "end_ms": b} for st, n, a, b in steps)


def _stepped(rid: str, arrival: float, prompt: int, queue: float, prefill: float, decode: float, *,
             queued_step: int, chunks: tuple[dict[str, float], ...], gaps: tuple[dict[str, float], ...] = (),
             preempt: int = 0) -> dict[str, Any]:
    return {**_timeline(rid, arrival, prompt, queue, prefill, decode, preempt=preempt), "queued_step": queued_step,
            "prefill_chunks": chunks, "longest_gaps": gaps}


def test_the_steps_it_waited_through_name_the_prompt_chunks_computed_in_them() -> None:
    """s (20 tokens) is queued before step 5 while l's 2,048-token prompt goes in 512-token chunks (steps 4-7);
    s is prefilled in step 7 beside l's last chunk. c's chunk (step 9) came after s's first token; d decoded only.
    s's 400 ms pause between tokens came while b's prompt was computed, and its preemption's recompute later."""
    s = _stepped("s", 100.0, 20, queue=350.0, prefill=100.0, decode=700.0, queued_step=5,
                 chunks=_chunks((7, 20, 351.0, 451.0), (14, 28, 1100.0, 1130.0)),
                 gaps=({"gap_ms": 400.0, "end_ms": 1000.0}, {"gap_ms": 40.0, "end_ms": 500.0}), preempt=1)
    others = [_stepped("l", 99.8, 2048, queue=0.0, prefill=650.0, decode=50.0, queued_step=4,
                       chunks=_chunks(*((4 + i, 512, 1.0 + 100 * i, 101.0 + 100 * i) for i in range(4)))),
              _stepped("c", 100.5, 300, queue=0.0, prefill=50.0, decode=50.0, queued_step=8,
                       chunks=_chunks((9, 300, 1.0, 51.0))),
              _stepped("b", 100.6, 900, queue=0.0, prefill=380.0, decode=50.0, queued_step=10,
                       chunks=_chunks((11, 900, 1.0, 381.0))),
              _timeline("d", 99.0, 10, queue=0.0, prefill=5.0, decode=3000.0)]
    e = explain({"request": s, "overlapping": others})
    assert e.steps_to_first_token == 3 and e.chunk_tokens == (20,) and e.recomputed_tokens == 28
    assert [(b.request_id, b.num_tokens, b.num_chunks) for b in e.blockers] == [("l", 1536, 3)]
    assert e.blockers[0].overlap_ms == pytest.approx(300.0, abs=0.5)
    assert [(st.gap_ms, [x.request_id for x in st.shares]) for st in e.stalls] == [(400.0, ["b"])]
    text = "\n".join(e.lines)
    assert "first token came in the 3rd engine step after it was queued; its prompt was computed in one step" in text
    assert "waited behind request l: 3 chunk(s) of its 2,048-token prompt (1,536 tokens" in text
    assert "a 400 ms pause between its tokens (1.00 s after arrival) came while the engine computed request b's " \
           "prompt (900 tokens)" in text
    assert "(28 tokens recomputed)" in text and e.to_json()["stalls"][0]["by"][0]["request_id"] == "b"


def test_the_longest_gaps_the_ring_keeps() -> None:
    metrics = RequestMetrics("r", 10, 5, 0, 0, "length", 0.0, 0.0, 0.1, 0.2, 0.7, 0.9,
                             inter_token_latencies=(0.1, 0.4, 0.05, 0.15))
    assert longest_gaps(metrics, 2) == ({"gap_ms": 400.0, "end_ms": pytest.approx(700.0)},
                                        {"gap_ms": 150.0, "end_ms": pytest.approx(900.0)})
    assert longest_gaps(RequestMetrics("q", 1, 1, 0, 0, "length", 0, 0, 0.1, 0.1, 0.0, 0.1, ())) == ()


def test_the_ring_is_bounded_and_keeps_the_newest() -> None:
    ring = TimelineRing(size=3)
    for i in range(5):
        ring.add(RequestTimeline(**_timeline(f"r{i}", float(i), 10, 0.0, 10.0, 10.0)))
    assert ring.get("r0") is None and ring.get("r1") is None and ring.get("r4") is not None
    target = ring.get("r3")
    assert target is not None and [t.request_id for t in ring.overlapping(target)] == []  # 22 ms lives, 1 s apart


def _complete(url: str, prompt: str, out: dict[str, Any], key: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    resp = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    out[prompt[:5]] = resp.json()["kvpilot"]["request_id"]


@pytest.mark.slow
def test_doctor_request_names_the_long_prompt_a_short_one_waited_behind(llm_fp32) -> None:
    long_prompt = "long " + " ".join(["the quick brown fox jumps over the lazy dog"] * 100)  # ~900 tokens
    ids: dict[str, Any] = {}
    with kvpilot_server(llm_fp32.loaded, api_key=KEY, max_num_batched_tokens=256) as server:
        first = threading.Thread(target=_complete, args=(server.url, long_prompt, ids, KEY))
        first.start()
        time.sleep(0.1)  # the long prompt is in its (one-step) prefill of several hundred ms on this CPU
        _complete(server.url, "short hello there", ids, KEY)
        first.join()
        with pytest.raises(DoctorInputError, match="--api-key"):
            fetch_timelines(server.url, ids["short"], {})
        answer = explain(fetch_timelines(server.url, ids["short"], {"Authorization": f"Bearer {KEY}"}))
        blocker = explain(fetch_timelines(server.url, ids["long "], {"Authorization": f"Bearer {KEY}"}))
        cli = CliRunner().invoke(_app(), ["doctor", "--url", server.url, "--request", ids["short"], "--api-key", KEY])
        # the bench report's doctor section: the run's slowest requests, as bench records them
        result = {"config": {"target": {"base_url": server.url}},
                  "runs": [{"requests": [_record(ids["short"], 1500.0, lag=40.0), _record(ids["long "], 900.0),
                                         _record("cmpl-gone", 1200.0)]}]}
        explained, notes = explain_slowest(result, {"Authorization": f"Bearer {KEY}"})
    assert [b.request_id for b in answer.blockers][:1] == [ids["long "]], answer.lines
    assert answer.blockers[0].prompt_tokens > 500
    # the 256-token step budget splits the long prompt into chunks, one per step; the short one waited through
    # some of those steps (it is admitted beside the long prompt's last chunk, the one that leaves room)
    assert len(blocker.chunk_tokens) == -(-blocker.prompt_tokens // 256) and max(blocker.chunk_tokens) == 256
    assert blocker.blockers == ()  # the short prompt shared its last step, but 3 tokens held nothing up
    assert answer.steps_to_first_token is not None and answer.steps_to_first_token >= 2, answer.lines
    assert answer.blockers[0].num_chunks is not None and answer.blockers[0].num_chunks >= 2, answer.lines
    assert answer.blockers[0].num_tokens == 256 * (answer.blockers[0].num_chunks - 1) + blocker.chunk_tokens[-1]
    assert cli.exit_code == 0 and f"waited behind request {ids['long ']}" in cli.output, cli.output
    assert [e.request_id for e in explained] == [ids["short"], ids["long "]]  # slowest first, the unknown one noted
    assert any(f"waited behind request {ids['long ']}" in line for line in explained[0].lines)
    assert "sent it 40 ms after it was due" in " ".join(explained[0].lines)
    assert len(notes) == 1 and "cmpl-gone" in notes[0] and "no timeline" in notes[0]
    html = slowest_html(explained, notes)
    assert f"waited behind request {ids['long ']}" in html and "cmpl-gone" in html


def _record(request_id: str, e2e_ms: float, lag: float = 0.0, server_e2e_ms: float = 100.0) -> dict[str, Any]:
    """The parts of a bench request record the report's explanation reads."""
    return {"ok": True, "e2e_ms": e2e_ms, "sched_lag_ms": lag,
            "server": {"request_id": request_id, "e2e_ms": server_e2e_ms}}


def test_the_slowest_records_and_what_the_client_adds() -> None:
    """Only requests with kvpilot's timings, slowest first; late sending and time outside the server are said,
    sub-millisecond noise is not."""
    records = [_record("a", 300.0), _record("b", 900.0, lag=25.0, server_e2e_ms=700.0),
               {"ok": True, "e2e_ms": 5000.0, "server": None}, {"ok": False, "e2e_ms": 9000.0},
               _record("c", 600.0), _record("d", 100.4, server_e2e_ms=100.0)]
    result = {"runs": [{"requests": records[:3]}, {"requests": records[3:]}]}
    assert [r["server"]["request_id"] for r in slowest_records(result)] == ["b", "c", "a"]
    assert client_lines(records[1]) == ["the load generator sent it 25 ms after it was due (a busy client)",
                                        "200 ms of the 900 ms the client measured were outside the server "
                                        "(network, the client's own event loop)"]
    assert client_lines(records[5]) == []
    assert explain_slowest({"runs": result["runs"]}, {}) == ([], [])  # no base URL: nothing to ask
    gone = {"config": {"target": {"base_url": "http://127.0.0.1:9"}}, **result}  # nothing listens on port 9
    explained, notes = explain_slowest(gone, {})
    assert explained == [] and len(notes) == 1 and notes[0].startswith("the server did not answer")


def _app() -> Any:
    from kvpilot.cli import app  # noqa: PLC0415

    return app


def test_a_timeline_of_another_shape_is_a_note_not_a_broken_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench report is written after the run: an answer at the timeline route that is not kvpilot's must not
    stop it (the request's note says so)."""
    import kvpilot.doctor.request_explain as request_explain  # noqa: PLC0415

    monkeypatch.setattr(request_explain, "fetch_timelines", lambda *_: {"request": {"timings": None}})
    result = {"config": {"target": {"base_url": "http://127.0.0.1:9"}}, "runs": [{"requests": [_record("x", 5.0)]}]}
    explained, notes = explain_slowest(result, {})
    assert explained == [] and len(notes) == 1 and "not kvpilot's" in notes[0]
