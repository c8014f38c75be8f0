"""Through the server, with the engine core in its own process: async and synchronous scheduling give the
same greedy outputs for concurrent requests under KV pressure (preemptions), with chunked prefill and stop
strings found one step late."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from tests.model.reference import long_text
from tests.server.conftest import server_engine_args
from tests.server.metrics_text import samples, value

pytestmark = pytest.mark.slow
MODEL = "smollm2-async"


def _requests() -> list[dict]:
    words = long_text(4).split()
    bodies = []
    for i in range(24):
        prompt = " ".join(words[3 * i: 3 * i + 20 + 9 * (i % 5)])
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24 + 3 * (i % 6), "temperature": 0}
        if i % 2:
            body["stop"] = [" the", ",", "."]
        else:
            body["ignore_eos"] = True
        bodies.append(body)
    return bodies


def _serve_all(async_scheduling: bool) -> tuple[list[tuple[str, str]], float]:
    args = server_engine_args(kv_cache_memory="8MiB", max_model_len=160, max_num_batched_tokens=128, max_num_seqs=32,
                              async_scheduling=async_scheduling)
    app = create_app(engine_factory(args), ServerArgs(served_model_names=(MODEL,)))
    with BackgroundServer(app, timeout_s=120) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        assert server.state.client.core_pid is not None  # the core runs in its own process
        with ThreadPoolExecutor(max_workers=24) as pool:
            responses = list(pool.map(lambda body: http.post("/v1/completions", json=body), _requests()))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
        choices = [r.json()["choices"][0] for r in responses]
        return [(c["text"], c["finish_reason"]) for c in choices], value(samples(http), "vllm:num_preemptions_total")


def test_async_and_sync_scheduling_serve_identical_outputs():
    sync_outputs, sync_preemptions = _serve_all(async_scheduling=False)
    async_outputs, async_preemptions = _serve_all(async_scheduling=True)
    assert async_outputs == sync_outputs
    assert sync_preemptions > 0 and async_preemptions > 0  # the KV cache was really under pressure
    assert sum(reason == "stop" for _, reason in async_outputs) >= 4
