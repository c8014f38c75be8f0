"""The engine core in its own process (the default): requests, outputs, step stats and queries cross the
message boundary; a killed core fails every request with 503 engine_failed and /health with it, nothing
hangs; shutdown and a dead server both leave no core process behind.

A 2-layer dummy model with a 4096-token vocabulary (no tokenizer: prompts are token ids) keeps each core's
start to seconds; the session's live server (conftest.py) covers text, chat and the tokenizer the core sends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpilot.engine.scheduler_stats import SchedulerStats
from kvpilot.launch.args import EngineArgs
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer, free_port
from kvpilot.server.core.messages import StatsQuery
from tests.server.metrics_text import samples, value

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = get_hf_config("smollm2-135m")
    config["num_hidden_layers"] = 2
    config["vocab_size"] = 4096  # below the embedded tokenizer's: no tokenizer to build, a cheap output layer
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(config))
    return path


def tiny_args(config: Path, **overrides: object) -> EngineArgs:
    settings: dict[str, object] = dict(model=str(config), load_format="dummy", dtype="float32",
                                       max_model_len=512, kv_cache_memory="16MiB")
    settings.update(overrides)
    return EngineArgs(**settings)  # type: ignore[arg-type]


@pytest.fixture()
def core_server(tiny_config: Path) -> Iterator[BackgroundServer]:
    app = create_app(engine_factory(tiny_args(tiny_config)), ServerArgs(served_model_names=(MODEL,)))
    with BackgroundServer(app, timeout_s=60) as server:
        yield server


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by its new parent, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _wait_gone(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs after {timeout_s} s"
        time.sleep(0.05)


def test_round_trip_through_the_core_process_then_shutdown_leaves_no_process(tiny_config: Path) -> None:
    app = create_app(engine_factory(tiny_args(tiny_config)), ServerArgs(served_model_names=(MODEL,)))
    with BackgroundServer(app, timeout_s=60) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        pid = server.state.client.core_pid
        assert pid is not None and pid != os.getpid() and _alive(pid)
        whole = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 5,
                                                   "temperature": 0, "ignore_eos": True, "logprobs": 2})
        assert whole.status_code == 200, whole.text
        assert whole.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                                         "prompt_tokens_details": {"cached_tokens": 0}}
        assert len(whole.json()["choices"][0]["logprobs"]["top_logprobs"]) == 5
        body = {"model": MODEL, "prompt": [8, 9], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = [line for line in response.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
        # the event loop reads the core's pipe itself: no reader thread (only the writer's)
        names = {t.name for t in threading.enumerate()}
        assert "kvpilot-core-writer" in names and "kvpilot-core-reader" not in names
        # on_step fired in the server process for every step; the snapshot and queries come from the core
        metrics = samples(http)
        assert value(metrics, "vllm:iteration_tokens_total_count") >= 9  # a prefill and 4+3 decode steps
        stats = server.run_on_loop(server.state.client.query(StatsQuery))
        assert isinstance(stats, SchedulerStats) and stats.num_running == 0
        assert http.get("/v1/kvpilot/integrity").json()["ok"] is True
    assert not _alive(pid)  # joined by the server's shutdown, not left to the OS


def test_killed_core_fails_in_flight_requests_and_health_without_hanging(core_server: BackgroundServer) -> None:
    url, pid = core_server.url, core_server.state.client.core_pid
    assert pid is not None
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    whole: dict[str, httpx.Response] = {}
    waiter = threading.Thread(target=lambda: whole.setdefault("r", httpx.post(f"{url}/v1/completions",
                                                                                json=body, timeout=60)))
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # streaming has begun
            waiter.start()
            deadline = time.monotonic() + 30
            while core_server.state.client.num_in_flight < 2:
                assert time.monotonic() < deadline, "the second request never reached the engine"
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            events = [line for line in lines if line.startswith("data:")]
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert error["type"] == "engine_failed" and "SIGKILL" in error["message"]
        waiter.join(30)
        assert whole["r"].status_code == 503 and whole["r"].json()["error"]["type"] == "engine_failed"
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "engine_failed"
        assert "SIGKILL" in health.json()["error"]["message"]
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 1})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "engine_failed"
        assert http.get("/v1/kvpilot/integrity").status_code == 503


def test_load_failure_in_the_core_process_is_reported(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    app = create_app(engine_factory(EngineArgs(model=str(missing))), ServerArgs(served_model_names=(MODEL,)))
    with BackgroundServer(app, wait_ready=False) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        deadline = time.monotonic() + 60
        while (health := http.get("/health")).json()["error"]["type"] != "engine_failed":
            assert time.monotonic() < deadline, "the load failure was never reported"
            time.sleep(0.05)
        assert health.status_code == 503 and str(missing) in health.json()["error"]["message"]
        pid = server.state.client.core_pid
    assert pid is not None and not _alive(pid)


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the running children of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_text().replace("\0", " ")
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append((int(entry.name), cmdline))
    return found


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_core_exits_when_the_server_process_dies(tiny_config: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "kvpilot.server", "--model", str(tiny_config), "--load-format", "dummy",
               "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "16MiB",
               "--port", str(port), "--served-model-name", MODEL]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    core: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not _healthy(f"http://127.0.0.1:{port}"):
            assert server.poll() is None, server.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.05)
        core = [p for p, cmd in _children(server.pid) if "spawn_main" in cmd]  # not the resource tracker
        assert len(core) == 1, _children(server.pid)
        server.kill()  # no shutdown message: the core must notice on its own
        server.wait(10)
        _wait_gone(core[0], 15)
    finally:
        if server.poll() is None:
            server.kill()
        server.communicate()
        for pid in core:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_http_side_imports_neither_torch_nor_the_model() -> None:
    """The server process's own modules stay light; only the core (served_engine.py) loads the model."""
    code = ("import sys\n"
            "import kvpilot.server.app, kvpilot.server.background, kvpilot.server.drain\n"
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvpilot.model'))\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
