"""Issue 14, reliability: a disconnect storm. Hundreds of streams start at once and about 30% of the clients
hang up mid-stream; the others get their whole answer, the cut ones are aborted, and afterwards the
scheduler's invariants hold (GET /v1/kvpilot/integrity), no KV block is left in use and nothing is running or
waiting. Loopback only, greedy decoding on a 2-layer dummy-weight model, a few dozen tokens a stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from kvpilot.server.background import BackgroundServer
from tests.server.metrics_text import samples, value
from tests.server.tiny_server import MODEL, integrity, tiny_server, write_tiny_config

NUM_STREAMS = 200
NUM_TOKENS = 12
CUT_AFTER_CHUNKS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = write_tiny_config(tmp_path_factory.mktemp("tiny"))
    with tiny_server(config, engine={"kv_cache_memory": "64MiB", "max_num_seqs": 256}, api_key="k") as running:
        yield running


def _cut(index: int) -> bool:
    return index % 10 < 3  # 30% of the clients leave


async def _stream(client: httpx.AsyncClient, index: int) -> tuple[str, int]:
    body = {"model": MODEL, "prompt": f"Story number {index}:", "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}", chunks
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return "done", chunks
            if line.startswith("data:"):
                chunks += 1
                if _cut(index) and chunks == CUT_AFTER_CHUNKS:
                    return "cut", chunks  # leaving the block closes the connection mid-stream
    return "ended early", chunks


async def _storm(url: str) -> list[tuple[str, int]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer k"}, timeout=120,
                                 limits=limits) as client:
        return await asyncio.gather(*(_stream(client, i) for i in range(NUM_STREAMS)))


def _settled(http: httpx.Client) -> dict:
    deadline = time.monotonic() + 60
    state = integrity(http)
    while state["num_running"] or state["num_waiting"] or state["num_used_blocks"]:
        assert time.monotonic() < deadline, f"the engine never settled: {state}"
        time.sleep(0.05)
        state = integrity(http)
    return state


def test_disconnect_storm_leaves_nothing_behind(server) -> None:
    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer k"}, timeout=60) as http:
        before = samples(http)
        started = time.monotonic()
        outcomes = asyncio.run(_storm(server.url))
        wall = time.monotonic() - started
        state = _settled(http)
        after = samples(http)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    num_cut = sum(1 for kind, _ in outcomes if kind == "cut")
    num_done = sum(1 for kind, _ in outcomes if kind == "done")
    aborted, finished = delta("vllm:request_success_total", finished_reason="abort"), \
        delta("vllm:request_success_total", finished_reason="length")
    print(f"\ndisconnect storm: {NUM_STREAMS} streams x {NUM_TOKENS} tokens in {wall:.1f} s; {num_cut} cut after "
          f"{CUT_AFTER_CHUNKS} chunks, {num_done} complete; engine: {aborted:.0f} aborted, {finished:.0f} finished "
          f"(length); after: running {state['num_running']}, waiting {state['num_waiting']}, used blocks "
          f"{state['num_used_blocks']}, integrity ok={state['ok']}")
    assert num_cut == sum(1 for i in range(NUM_STREAMS) if _cut(i)) and num_done == NUM_STREAMS - num_cut, outcomes
    assert aborted + finished == NUM_STREAMS and 0 < aborted <= num_cut
    assert state["ok"] and state["num_used_blocks"] == 0
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
