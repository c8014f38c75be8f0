"""`kvpilot serve` as users start it: the HTTP process never loads torch or the model (the engine core process
does), so HTTP work, tokenization and the core never share a GIL or the memory of two torch runtimes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvpilot.server.background import free_port

pytestmark = pytest.mark.slow


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _children(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children.extend(int(c) for c in (task / "children").read_text().split())
    return children


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps (Linux)")
def test_the_http_process_never_maps_torch_while_the_core_does(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as log_file:  # a file, not a pipe: nothing here reads it while the server runs
        process = subprocess.Popen([sys.executable, "-m", "kvpilot.server", "--port", str(port), "--max-model-len",
                                    "512", "--kv-cache-memory", "64MiB"], stdout=subprocess.DEVNULL,
                                   stderr=log_file, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
                              timeout=120)
        assert response.status_code == 200  # it tokenized and detokenized a request end to end
        cores = [pid for pid in _children(process.pid) if "libtorch" in _maps(pid)]
        assert cores, "no child process with torch: the engine core should run in one"
        assert "libtorch" not in _maps(process.pid)
        # issue 46: the start-up says when it answers, with the URL (before /health turned 200)
        assert f"kvpilot serve: ready at http://127.0.0.1:{port}/v1" in log.read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
