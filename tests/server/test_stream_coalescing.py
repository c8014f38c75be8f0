"""A stream whose HTTP side falls behind the engine sends the queued steps merged into one chunk (sub_requests.py,
Coalescing), and every chunk still carries exactly its own tokens' text and logprobs."""

from __future__ import annotations

import json
import threading
import time

from kvpilot.server.background import BackgroundServer

from .conftest import MODEL, authed_http

BODY = {"model": MODEL, "prompt": "The history of the printing press", "max_tokens": 40, "temperature": 0,
        "ignore_eos": True, "logprobs": 2}
STALL_S = 0.8  # the server's event loop is blocked this long: the engine core (own process) steps on meanwhile


async def _stall_event_loop() -> None:
    time.sleep(STALL_S)  # blocks the loop on purpose, as a burst of CPU work on the HTTP side would


def _stream_with_a_stall(server: BackgroundServer) -> list[dict]:
    """The completion's chunks (the usage-only one dropped); the loop is stalled after the first chunk."""
    chunks: list[dict] = []
    stalled = threading.Event()
    with authed_http(server) as http, http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                chunks.append(chunk["choices"][0])
            if not stalled.is_set():
                stalled.set()
                threading.Thread(target=server.run_on_loop, args=(_stall_event_loop(),), daemon=True).start()
    return chunks


def test_a_lagging_stream_merges_steps_and_keeps_each_chunks_logprobs(live_server: BackgroundServer) -> None:
    with authed_http(live_server) as http:
        whole = http.post("/v1/completions", json=BODY).json()["choices"][0]
    chunks = _stream_with_a_stall(live_server)
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    assert len(tokens) == len(whole["logprobs"]["tokens"]) == 40
    assert len(chunks) < 40, "the steps produced while the loop was stalled came in one chunk each"
    assert any(len(c["logprobs"]["tokens"]) > 1 for c in chunks)
    # Each chunk's logprobs belong to its own text, in order: they add up to the whole answer's.
    assert "".join(c["text"] for c in chunks) == whole["text"] == "".join(tokens)
    assert tokens == whole["logprobs"]["tokens"]
    for c in chunks:
        assert "".join(c["logprobs"]["tokens"]) == c["text"]
    assert [o for c in chunks for o in c["logprobs"]["text_offset"]] == whole["logprobs"]["text_offset"]
    streamed = [lp for c in chunks for lp in c["logprobs"]["token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(streamed, whole["logprobs"]["token_logprobs"])) < 1e-4
    assert chunks[-1]["finish_reason"] == "length"
