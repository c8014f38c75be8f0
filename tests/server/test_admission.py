"""Queue caps: beyond --max-num-queued-reqs / --max-num-queued-tokens the server answers 429 with Retry-After
at once, while the admitted requests are still served."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest

from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from tests.server.conftest import server_engine_args
from tests.server.metrics_text import samples, value


@pytest.fixture()
def capped_server(llm_fp32):
    """One request runs at a time (max_num_seqs=1); at most 2 requests and 64 prompt tokens may wait."""
    app = create_app(engine_factory(server_engine_args(max_num_seqs=1, kv_cache_memory="64MiB"), llm_fp32.loaded, warmup=False),
                     ServerArgs(served_model_names=("m",), max_num_queued_reqs=2, max_num_queued_tokens=64,
                                engine_process=False))
    with BackgroundServer(app) as server:
        yield server


def _wait_for(client: httpx.Client, name: str, target: float) -> None:
    deadline = time.monotonic() + 30
    while value(samples(client), name) != target:
        assert time.monotonic() < deadline, f"{name} never reached {target}"
        time.sleep(0.02)


def _rejected(client: httpx.Client, prompt: list[int], code: str, flag: str) -> None:
    response = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2})
    assert response.status_code == 429, response.text
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert error["type"] == code and flag in error["message"]


def test_429_when_queue_is_full_while_admitted_requests_finish(capped_server) -> None:
    def body(prompt: list[int], max_tokens: int) -> dict:
        return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}

    with ExitStack() as stack:
        clients = [stack.enter_context(httpx.Client(base_url=capped_server.url, timeout=120)) for _ in range(3)]
        running = stack.enter_context(clients[0].stream("POST", "/v1/completions", json=body([1, 2, 3], 400)))
        running_lines = running.iter_lines()  # keep a reference: a collected iterator closes the stream
        assert next(line for line in running_lines if line.startswith("data:"))  # the first request runs
        waiting = stack.enter_context(clients[1].stream("POST", "/v1/completions",
                                                        json=body(list(range(100, 140)), 3)))
        _wait_for(clients[2], "vllm:num_requests_waiting", 1)
        _rejected(clients[2], list(range(200, 240)), "queue_full_tokens", "--max-num-queued-tokens")  # 40+40 > 64
        small = stack.enter_context(clients[2].stream("POST", "/v1/completions", json=body([7, 8, 9], 2)))
        _wait_for(clients[0], "vllm:num_requests_waiting", 2)
        with httpx.Client(base_url=capped_server.url, timeout=120) as extra:
            _rejected(extra, [5], "queue_full_requests", "--max-num-queued-reqs")
            assert value(samples(extra), "kvpilot:requests_rejected_total", reason="queue_full") == 2
        # The running request kept streaming; closing it lets the admitted ones run to their end.
        assert next(line for line in running_lines if line.startswith("data:"))
        running.close()
        for response in (waiting, small):
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data:")]
            assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
