"""Queue caps: beyond --max-num-queued-reqs / --max-num-queued-tokens the server answers 429 with Retry-After
at once, while the admitted requests are still served. (The token cap's arithmetic: test_units.py.)"""

from __future__ import annotations

import time

import httpx
import pytest

from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from tests.server.conftest import server_engine_args
from tests.server.metrics_text import samples, value


@pytest.fixture()
def capped_server(llm_fp32):
    """One request runs at a time (max_num_seqs=1) and one may wait."""
    app = create_app(engine_factory(server_engine_args(max_num_seqs=1), llm_fp32.loaded, warmup=False),
                     ServerArgs(served_model_names=("m",), max_num_queued_reqs=1))
    with BackgroundServer(app) as server:
        yield server


def _wait_for(client: httpx.Client, name: str, target: float) -> None:
    deadline = time.monotonic() + 30
    while value(samples(client), name) != target:
        assert time.monotonic() < deadline, f"{name} never reached {target}"
        time.sleep(0.02)


def test_429_when_queue_is_full_while_admitted_requests_finish(capped_server) -> None:
    long_body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                 "stream": True}
    with httpx.Client(base_url=capped_server.url, timeout=120) as client, \
            httpx.Client(base_url=capped_server.url, timeout=120) as other:
        with client.stream("POST", "/v1/completions", json=long_body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # the first request is running
            with other.stream("POST", "/v1/completions",
                              json={**long_body, "prompt": [4, 5, 6], "max_tokens": 3}) as waiting:
                _wait_for(client, "vllm:num_requests_waiting", 1)
                rejected = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
                assert rejected.status_code == 429
                assert int(rejected.headers["Retry-After"]) >= 1
                error = rejected.json()["error"]
                assert error["code"] == "queue_full_requests" and "--max-num-queued-reqs" in error["message"]
                assert value(samples(client), "kvpilot:requests_rejected_total", reason="queue_full") == 1
                # The running request keeps streaming; closing it lets the waiting one run to its end.
                assert next(line for line in lines if line.startswith("data:"))
                running.close()
                events = [line for line in waiting.iter_lines() if line.startswith("data:")]
                assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
