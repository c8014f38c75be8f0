"""Issue 14, reliability: overload at four times saturation. The server runs at most MAX_NUM_SEQS requests and
lets QUEUE_CAP more wait; a burst of four times that many gets 429 + Retry-After at once for the excess
(decided before tokenizing), while every admitted request finishes with its full answer. Loopback only."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest

from kvpilot.server.background import BackgroundServer
from tests.server.metrics_text import samples, value
from tests.server.tiny_server import MODEL, integrity, tiny_server, write_tiny_config

MAX_NUM_SEQS = 4
QUEUE_CAP = 4
SATURATION = MAX_NUM_SEQS + QUEUE_CAP
NUM_REQUESTS = 4 * SATURATION
NUM_TOKENS = 16  # enough that no admitted request ends while the burst is still arriving


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = write_tiny_config(tmp_path_factory.mktemp("tiny"))
    with tiny_server(config, engine={"max_num_seqs": MAX_NUM_SEQS}, max_num_queued_reqs=QUEUE_CAP) as running:
        yield running


async def _one(client: httpx.AsyncClient, index: int) -> tuple[int, float, httpx.Response]:
    body = {"model": MODEL, "prompt": f"Request {index} says", "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True}
    started = time.monotonic()
    response = await client.post("/v1/completions", json=body)
    return response.status_code, time.monotonic() - started, response


async def _burst(url: str) -> list[tuple[int, float, httpx.Response]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        return await asyncio.gather(*(_one(client, i) for i in range(NUM_REQUESTS)))


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000 if len(values) > 1 else \
        (values[0] * 1000 if values else float("nan"))


def test_overload_gets_429_at_once_and_admitted_requests_finish(server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = samples(http)
        results = asyncio.run(_burst(server.url))
        after = samples(http)
        state = integrity(http)
    rejected = [(s, r) for code, s, r in results if code == 429]
    served = [(s, r) for code, s, r in results if code == 200]
    print(f"\noverload: {NUM_REQUESTS} requests at once against {MAX_NUM_SEQS} running + {QUEUE_CAP} waiting "
          f"({NUM_REQUESTS / SATURATION:.0f}x saturation): {len(served)} served, {len(rejected)} got 429; "
          f"429 latency p50 {_p([s for s, _ in rejected], 50):.1f} ms, p99 {_p([s for s, _ in rejected], 99):.1f} "
          f"ms; served e2e p50 {_p([s for s, _ in served], 50):.0f} ms, max {max(s for s, _ in served) * 1000:.0f} ms")
    assert len(rejected) + len(served) == NUM_REQUESTS, [code for code, _, _ in results]
    assert len(rejected) >= NUM_REQUESTS - SATURATION and len(served) >= MAX_NUM_SEQS
    for _, response in rejected:
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["type"] == "queue_full_requests"
    for _, response in served:
        assert response.json()["usage"]["completion_tokens"] == NUM_TOKENS
    rejected_metric = value(after, "kvpilot:requests_rejected_total", reason="queue_full") - \
        value(before, "kvpilot:requests_rejected_total", reason="queue_full")
    assert rejected_metric == len(rejected)
    assert state["ok"] and state["num_running"] == 0 and state["num_used_blocks"] == 0
