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
from kvpilot.server.observe.request_timelines import RequestTimeline, TimelineRing
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
    with kvpilot_server(llm_fp32.loaded, api_key=KEY, max_num_batched_tokens=4096) as server:
        first = threading.Thread(target=_complete, args=(server.url, long_prompt, ids, KEY))
        first.start()
        time.sleep(0.1)  # the long prompt is in its (one-step) prefill of several hundred ms on this CPU
        _complete(server.url, "short hello there", ids, KEY)
        first.join()
        with pytest.raises(DoctorInputError, match="--api-key"):
            fetch_timelines(server.url, ids["short"], {})
        answer = explain(fetch_timelines(server.url, ids["short"], {"Authorization": f"Bearer {KEY}"}))
        cli = CliRunner().invoke(_app(), ["doctor", "--url", server.url, "--request", ids["short"], "--api-key", KEY])
        # the bench report's doctor section: the run's slowest requests, as bench records them
        result = {"config": {"target": {"base_url": server.url}},
                  "runs": [{"requests": [_record(ids["short"], 1500.0, lag=40.0), _record(ids["long "], 900.0),
                                         _record("cmpl-gone", 1200.0)]}]}
        explained, notes = explain_slowest(result, {"Authorization": f"Bearer {KEY}"})
    assert [b.request_id for b in answer.blockers][:1] == [ids["long "]], answer.lines
    assert answer.blockers[0].prompt_tokens > 500
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
