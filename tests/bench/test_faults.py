"""Bad input: unreachable server, 4xx/5xx, 429s, dying mid-stream, malformed SSE: counted, no raise."""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Callable

from kvpilot.bench.client import MAX_RESENDS, Target, build_payload, execute, open_session
from kvpilot.bench.datasets import DatasetConfig, build_dataset
from kvpilot.bench.load import LoadShape
from kvpilot.bench.runner import run_load
from kvpilot.bench.stats import aggregate
from kvpilot.bench.tokens import WordTokenizer
from tests.doubles.scripted_process import ScriptedProcess, free_port
from tests.doubles.scripted_server import Behavior

from .scripted_helpers import run_scripted

OK = Behavior(ttft_s=0.005, itl_s=0.002, num_output_tokens=4)


def test_unreachable_server_counts_connect_errors() -> None:
    tok = WordTokenizer()
    items = build_dataset(DatasetConfig(input_len=4, output_len=4), tok, 5)
    target = Target(f"http://127.0.0.1:{free_port()}", "m", timeout_s=5.0)
    out = asyncio.run(run_load(target, items, LoadShape(concurrency=2, num_requests=5), tok,
                               metrics_url=target.base_url + "/metrics"))
    agg = aggregate(out.records, {})
    assert agg.num_ok == 0 and agg.errors_by_kind == {"connect_error": 5}
    assert "cannot connect" in (out.records[0].error or "")
    assert out.metrics == [] and out.metrics_error is not None


def test_http_errors_are_counted_by_status_with_retry_after(scripted: ScriptedProcess) -> None:
    scripted.set_script(OK, Behavior(status=429, retry_after_s=2), Behavior(status=500),
                        Behavior(status=400))
    out = run_scripted(scripted, LoadShape(concurrency=1, num_requests=8), num_items=8)
    agg = aggregate(out.records, {})
    assert agg.num_ok == 2
    assert agg.errors_by_kind == {"http_429": 2, "http_500": 2, "http_400": 2}
    throttled = [r for r in out.records if r.status == 429]
    assert all(r.retry_after_s == 2.0 and r.ttft_ms is None for r in throttled)
    assert "scripted 500" in next(r.error for r in out.records if r.status == 500)


def test_server_dying_mid_stream_is_stream_incomplete(scripted: ScriptedProcess) -> None:
    scripted.set_script(OK, Behavior(ttft_s=0.005, itl_s=0.002, num_output_tokens=6, die_after_tokens=3))
    out = run_scripted(scripted, LoadShape(concurrency=2, num_requests=6), num_items=6)
    agg = aggregate(out.records, {})
    assert agg.num_ok == 3 and agg.errors_by_kind == {"stream_incomplete": 3}
    broken = [r for r in out.records if not r.ok]
    assert all(r.status == 200 and r.num_chunks == 3 and r.num_output_tokens == 0 for r in broken)


def test_malformed_sse_is_counted(scripted: ScriptedProcess) -> None:
    scripted.set_script(Behavior(ttft_s=0.005, itl_s=0.002, num_output_tokens=5, malformed_after_tokens=2), OK)
    out = run_scripted(scripted, LoadShape(concurrency=1, num_requests=4), num_items=4)
    agg = aggregate(out.records, {})
    assert agg.num_ok == 2 and agg.errors_by_kind == {"malformed_sse": 2}
    assert "not JSON" in next(r.error for r in out.records if not r.ok)


def test_failed_turn_ends_its_session_but_not_the_run(scripted: ScriptedProcess) -> None:
    scripted.set_script(OK, Behavior(status=503), OK, OK)
    ds = DatasetConfig(kind="multi-turn", input_len=4, output_len=4, num_turns=3)
    out = run_scripted(scripted, LoadShape(concurrency=1, num_requests=6), num_items=6, dataset=ds,
                       endpoint="chat")
    # Session 0: turn 0 ok, turn 1 fails -> turn 2 skipped; session 1 runs its turns.
    assert [(r.item_id, r.turn_index, r.ok) for r in out.records][:3] == [(0, 0, True), (0, 1, False), (1, 0, True)]


def test_a_silent_server_times_out(scripted: ScriptedProcess) -> None:
    scripted.set_script(Behavior(ttft_s=2.0, num_output_tokens=2), OK)
    tok = WordTokenizer()
    items = build_dataset(DatasetConfig(input_len=2, output_len=2), tok, 2)
    target = Target(scripted.base_url, scripted.model, timeout_s=0.2)
    out = asyncio.run(run_load(target, items, LoadShape(concurrency=1, num_requests=2), tok))
    assert [r.error_kind for r in out.records] == ["timeout", None]
    assert out.records[0].e2e_ms is not None and out.records[0].e2e_ms < 1000


async def _close_unanswered_server(close_request: Callable[[int, int], bool]) -> tuple[asyncio.Server, list[int]]:
    """An HTTP/1.1 keep-alive server answering each request with a small JSON completion, except the requests for
    which close_request(connection number, request number on it) is true: their connection closes unanswered.
    Returns the server and a one-item list counting the connections it accepted."""
    connections = [0]
    body = b'{"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}'

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        number = connections[0]
        try:
            for n in itertools.count(1):
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(re.search(rb"content-length: (\d+)", head, re.I).group(1)))
                if close_request(number, n):
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the client closed it
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), connections


def _send_three(close_request: Callable[[int, int], bool]) -> tuple[list, int]:
    async def scenario() -> tuple[list, int]:
        server, connections = await _close_unanswered_server(close_request)
        target = Target(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "m", stream=False, timeout_s=5.0)
        async with server, open_session(target) as session:
            outs = [await execute(session, target, build_payload(target, "x", None, 1)) for _ in range(3)]
        return outs, connections[0]

    return asyncio.run(scenario())


def test_a_kept_alive_connection_closed_unanswered_is_retried_on_a_new_one() -> None:
    """llama.cpp's server closes kept-alive connections under load: the request sent on one is sent again."""
    outs, connections = _send_three(lambda conn, n: conn == 1 and n == 2)
    assert [(o.ok, o.text) for o in outs] == [(True, "hi")] * 3
    assert connections == 2  # the retry's


def test_a_request_is_resent_a_bounded_number_of_times() -> None:
    outs, connections = _send_three(lambda conn, n: True)  # every request closed unanswered
    assert [o.error_kind for o in outs] == ["transport_error"] * 3
    assert all(o.status is None and "connection broke" in (o.error or "") for o in outs)
    assert connections == 3 * (1 + MAX_RESENDS)  # each request sent 1 + MAX_RESENDS times, each on a new connection
