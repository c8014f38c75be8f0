"""`kvpilot serve` in its own process for the benchmarks (imported by server_overhead.py, huge_prompt.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from kvpilot.server.background import free_port


def start_server(flags: list[str], timeout_s: float = 300, log_path: str | None = None,
                 unread_pipes: bool = False) -> tuple[subprocess.Popen, str]:
    """Starts `python -m kvpilot.server --port <free> *flags` and waits for /health 200; (process, url).
    RuntimeError (the process killed) if it exits or is not ready in time. log_path: the server's stdout and
    stderr go there (default: discarded); unread_pipes: both are pipes that nothing reads (hostile.py)."""
    port = free_port()
    command = [sys.executable, "-m", "kvpilot.server", "--port", str(port), *flags]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 (the child holds it)
    if unread_pipes:
        out, err = subprocess.PIPE, subprocess.PIPE
    else:
        out, err = log, subprocess.STDOUT if log_path else subprocess.DEVNULL
    process = subprocess.Popen(command, stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not start: {' '.join(command)}")
