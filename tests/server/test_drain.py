"""SIGTERM drains: new requests get 503 (and /health 503) while the in-flight one finishes; then exit 0.

A real `python -m kvpilot.server` process (same code as `kvpilot serve`) on a 2-layer, 4096-token-vocabulary dummy model, so it
starts in seconds.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.server.background import free_port
from tests.served_process import serve_process


@pytest.fixture()
def dummy_config(tmp_path: Path) -> Path:
    config = get_hf_config("smollm2-135m")
    config["num_hidden_layers"] = 2
    config["vocab_size"] = 4096  # a small output layer keeps each step cheap
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_sigterm_drains_then_exits_0(dummy_config: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kvpilot.server", "--model", str(dummy_config), "--load-format", "dummy",
               "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "32MiB", "--port", str(port),
               "--served-model-name", "dummy", "--drain-timeout", "60"]
    with serve_process(command, url, tmp_path / "server.log") as process:
        body = {"model": "dummy", "prompt": [1, 2, 3, 4], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=url, timeout=120) as client, client.stream("POST", "/v1/completions",
                                                                              json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(f"{url}/health", timeout=5).status_code != 503:
                assert time.monotonic() < deadline, "/health never turned 503"
                time.sleep(0.02)
            refused = httpx.post(f"{url}/v1/completions", timeout=30,
                                 json={"model": "dummy", "prompt": [1, 2], "max_tokens": 1})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "draining"
            events = [line for line in lines if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"  # the in-flight request finished in full
        assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=60) == 0


def test_drain_timeout_aborts_what_is_left(llm_fp32) -> None:
    """In-process: the drain deadline passes with a request in flight, which ends with finish_reason abort."""
    from kvpilot.server import ServerArgs, create_app, engine_factory
    from kvpilot.server.background import BackgroundServer
    from kvpilot.server.drain import drain
    from tests.server.conftest import server_engine_args

    app = create_app(engine_factory(server_engine_args(kv_cache_memory="64MiB"), llm_fp32.loaded, warmup=False),
                     ServerArgs(served_model_names=("m",), engine_process=False))
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            aborted = server.run_on_loop(drain(server.state, 0.2))
            events = [line for line in lines if line.startswith("data:")]
        assert aborted == 1
        assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
        assert client.get("/health").status_code == 503
        assert client.get("/v1/kvpilot/integrity").json()["num_used_blocks"] == 0
