"""Issue 14, the client commands against a real (tiny) server with an API key: the doctor takes the same key
story as bench and fit (`--api-key`, else OPENAI_API_KEY) and names the flag on 401; bench's progress goes to
stderr, so `> file` holds only the results even on a terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.server.background import BackgroundServer
from tests.server.tiny_server import KEY, tiny_server, write_tiny_config

KVPILOT = [sys.executable, "-m", "kvpilot.cli"]


def _run(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "KVPILOT_API_KEY")}
    return subprocess.run(KVPILOT + args, capture_output=True, text=True, timeout=timeout_s,
                          env={**clean, **(env or {})})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    # narrow: the commands' key and output handling are under test, not the model's shapes
    with tiny_server(write_tiny_config(tmp_path_factory.mktemp("tiny"), narrow=True), api_key=KEY) as running:
        yield running


def test_doctor_takes_the_key_from_the_environment_and_names_the_flag(server: BackgroundServer) -> None:
    refused = _run(["doctor", "--url", server.url, "--quick"])
    assert refused.returncode == 2 and "--api-key" in refused.stderr and "Traceback" not in refused.stderr
    wrong = _run(["doctor", "--url", server.url, "--quick", "--api-key", "wrong"])
    assert wrong.returncode == refused.returncode and "--api-key" in wrong.stderr
    # the shortest phases and 2 in flight: the key reached every probe request, not what they measured, is tested
    from_env = _run(["doctor", "--url", server.url, "--quick", "--json", "--phase-seconds", "1",
                     "--max-concurrency", "2"], env={"OPENAI_API_KEY": KEY})
    assert from_env.returncode in (0, 1), from_env.stderr[-2000:]  # healthy, or findings: the probe ran
    report = json.loads(from_env.stdout)
    assert isinstance(report, dict) and report  # the diagnosis, on stdout
    assert all(p["num_ok"] == p["num_sent"] > 0 for p in report["probe"]["phases"])  # every request had the key
    assert "httpx" not in from_env.stderr and "HTTP Request" not in from_env.stderr


def test_bench_progress_goes_to_stderr_results_to_stdout(server: BackgroundServer, tmp_path: Path) -> None:
    terminal = {"OPENAI_API_KEY": KEY, "TTY_COMPATIBLE": "1", "COLUMNS": "200"}  # rich: draw as on a terminal
    result = _run(["bench", "--base-url", server.url, "--num-requests", "4", "--input-len", "8", "--output-len",
                   "2", "--output", str(tmp_path / "result.json")], env=terminal)
    assert result.returncode == 0, result.stderr
    assert "errors:" in result.stderr  # the progress bar's columns
    assert "errors:" not in result.stdout and "Latency (ms)" in result.stdout and "Throughput" in result.stdout
    assert "Latency (ms)" not in result.stderr and "httpx" not in result.stderr  # results and no httpx log lines
    assert json.loads((tmp_path / "result.json").read_text())["runs"]
