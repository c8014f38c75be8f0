"""Issue 14, the command line around the server: an empty --api-key is refused at start-up, `kvpilot serve` on
a taken port fails before loading the model, and the clients share one API-key story (`--api-key`, else
OPENAI_API_KEY): bench says what to do on 401, `fit --url` logs no httpx lines. bench's results on stdout with
the key from the environment: test_clients_api_key.py's test_bench_progress_goes_to_stderr_results_to_stdout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.server.background import BackgroundServer
from kvpilot.server.cli import _queue_cap
from kvpilot.server.config import DEFAULT_MAX_NUM_QUEUED_REQS, ServerArgs, ServerConfigError
from tests.server.tiny_server import KEY, tiny_server, write_tiny_config

KVPILOT = [sys.executable, "-c", "from kvpilot.cli import main; main()"]


def _run(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "KVPILOT_API_KEY")}
    return subprocess.run(KVPILOT + args, capture_output=True, text=True, timeout=timeout_s,
                          env={**clean, **(env or {})})


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_config(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(tiny_config: Path) -> Iterator[BackgroundServer]:
    with tiny_server(tiny_config, api_key=KEY) as running:
        yield running


def test_empty_api_key_is_refused_at_start_up() -> None:
    with pytest.raises(ServerConfigError, match="--api-key is empty"):
        ServerArgs(api_key="")
    result = _run(["serve", "--api-key", ""], timeout_s=60)
    assert result.returncode == 2 and "--api-key is empty" in result.stderr
    assert "loading" not in result.stderr  # refused before anything was loaded


def test_ray_only_flags_without_ray_are_refused_before_anything_starts() -> None:
    from typer.testing import CliRunner

    from kvpilot.cli import app

    for flag in (["--num-replicas", "2"], ["--routing", "prefix"], ["--ray-config", "lanes.yaml"]):
        result = CliRunner().invoke(app, ["serve", *flag])
        assert result.exit_code == 2 and "need --ray" in result.output, (flag, result.output)


def test_queue_is_capped_by_default() -> None:
    assert ServerArgs().max_num_queued_reqs == DEFAULT_MAX_NUM_QUEUED_REQS
    assert _queue_cap(None, max_num_seqs=256) == 512 and _queue_cap(0, 256) is None and _queue_cap(7, 256) == 7
    assert _queue_cap(None, max_num_seqs=1) == 64  # a few clients' burst is queued, not refused


def test_serve_on_a_busy_port_fails_before_loading(tiny_config: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = _run(["serve", "--model", str(tiny_config), "--load-format", "dummy", "--port", str(port),
                       "--no-engine-process"], timeout_s=120)
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert "loading" not in result.stderr  # the model was never loaded


def test_bench_401_names_the_flag(server) -> None:
    result = _run(["bench", "--base-url", server.url, "--num-requests", "1", "--model", "tiny", "--no-progress",
                   "--api-key", "wrong"])
    assert result.returncode == 1 and "--api-key" in result.stderr
    unnamed = _run(["bench", "--base-url", server.url, "--num-requests", "1", "--no-progress"])
    assert unnamed.returncode == 2 and "--api-key" in unnamed.stderr


def test_fit_url_takes_the_api_key_and_logs_no_httpx_lines(server) -> None:
    result = _run(["fit", "--url", server.url, "--api-key", KEY, "--json"])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["actual"]["num_blocks"] > 0 and "httpx" not in result.stderr
    from_env = _run(["fit", "--url", server.url, "--json"], env={"OPENAI_API_KEY": KEY})
    assert from_env.returncode == 0, from_env.stderr
    refused = _run(["fit", "--url", server.url])
    assert refused.returncode == 2 and "--api-key" in refused.stderr
