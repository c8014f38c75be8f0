"""A `kvpilot serve` (or any HTTP server) subprocess for tests: started in its own process group with its output in
a file, ready once GET /health answers 200, killed with its whole group and reaped on exit, always.

Why a file and a group: a pipe nobody reads fills and blocks the server; its engine core is a child process that
must die with it. A start slower than ``stacks_after_s`` asks the server's processes for their Python stacks
(``kill -USR1``, docs/server.md "Where a server is stuck") and warns with them: on a busy machine a server took
minutes inside `import torch` (docs/benchmark-log.md, 2026-11-30), which a bare timeout would not have said.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx


def _tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-12000:]


def wait_healthy(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float = 300.0,
                 stacks_after_s: float = 60.0) -> None:
    """Until ``url``/health is 200. RuntimeError when ``process`` exits first or ``timeout_s`` passes (with the log's
    tail); past ``stacks_after_s`` the process group prints its stacks into the log, and a late start warns."""
    started, stacks = time.monotonic(), False
    while time.monotonic() < started + timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was healthy: {_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        if not stacks and time.monotonic() > started + stacks_after_s:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGUSR1)
            stacks = True
        time.sleep(0.1)
    else:
        raise RuntimeError(f"the server at {url} was not healthy after {timeout_s:.0f} s: {_tail(log_path)}")
    if stacks:
        warnings.warn(f"the server at {url} took {time.monotonic() - started:.0f} s to start; its stacks at "
                      f"{stacks_after_s:.0f} s: {_tail(log_path)}", stacklevel=2)


@contextlib.contextmanager
def serve_process(command: list[str], url: str, log_path: Path,
                  startup_s: float = 300.0) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` in a process group of its own, output (stdout and stderr) to ``log_path``; yields the process
    once ``url``/health answers 200 (:func:`wait_healthy`); SIGKILL to the group and reaped on exit."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(url, process, log_path, startup_s)
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):  # also an engine core left behind by an HTTP process gone
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
