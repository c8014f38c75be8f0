"""Starting and stopping one engine's server at a time.

Invariant: `running_server` stops its server's whole process group (vLLM and kvpilot start children) and
waits for the port to close before it returns, so the next engine never shares the CPU with the last one.
Its peak memory is read from /proc (VmHWM: each process's own peak resident set since it started), so it
works for any engine's server.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil


class ServerStartError(RuntimeError):
    """The server exited or was not ready in time; the message names its log."""


@dataclass(frozen=True)
class ServerSpec:
    """How to start one engine's OpenAI-compatible server on 127.0.0.1:`port`; ready when `ready_path` is 200."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    ready_path: str = "/health"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class RunningServer:
    """A started, ready server: where to reach it and its process (the leader of its process group)."""

    base_url: str
    pid: int

    def peak_rss_mib(self) -> float | None:
        """The sum over the server's processes (it and its descendants) of each one's peak RSS since it started
        (load included), in MiB; None where /proc gives none (not Linux, or the server is gone). Peaks of
        different processes may fall at different moments: this bounds the tree's peak from above."""
        try:
            root = psutil.Process(self.pid)
            pids = [self.pid, *(child.pid for child in root.children(recursive=True))]
        except psutil.Error:
            return None
        peaks_kib = [peak for peak in map(_vm_hwm_kib, pids) if peak is not None]
        return sum(peaks_kib) / 1024 if peaks_kib else None


def _vm_hwm_kib(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # exited meanwhile, or no /proc
        return None
    found = re.search(r"^VmHWM:\s*(\d+)\s*kB", status, re.MULTILINE)
    return int(found.group(1)) if found else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(spec: ServerSpec, log_path: Path, max_start_s: float) -> Iterator[RunningServer]:
    """Starts the server (output to `log_path`), yields it once ready, stops it on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        log.write(f"$ {' '.join(spec.command)}\n# env: {spec.env}\n")
        log.flush()
        process = subprocess.Popen(spec.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_ready(spec, process, log_path, max_start_s)
        yield RunningServer(spec.base_url, process.pid)
    finally:
        _stop(process)
        _wait_port_closed(spec.port, max_wait_s=30)


def _wait_ready(spec: ServerSpec, process: subprocess.Popen, log_path: Path, max_start_s: float) -> None:
    deadline = time.monotonic() + max_start_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(f"{spec.name} exited with {process.returncode} while starting; see {log_path}")
        try:
            if httpx.get(spec.base_url + spec.ready_path, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise ServerStartError(f"{spec.name} was not ready after {max_start_s:.0f} s; see {log_path}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        if process.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait_s)
    # Children left in the group (a worker that outlived its parent) go too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _wait_port_closed(port: int, max_wait_s: float) -> None:
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.2)
