"""Start and stop a server from a command line (``kvpilot doctor --serve "kvpilot serve ..."``).

The doctor runs the command in a process group of its own, on a free port unless the command names
one, waits until ``GET /health`` and ``GET /v1/models`` answer (the model is loaded), and stops the
whole group on exit (the engine core is a child of the server). A command that cannot start, exits,
or does not answer in time raises :class:`DoctorInputError` with the last line it logged: the CLI
prints that one line, exit code 2.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from kvpilot.doctor.engines import KVPILOT, LLAMACPP, SGLANG, TGI, VLLM
from kvpilot.doctor.errors import DoctorInputError
from kvpilot.doctor.resources import server_tree


@dataclass(frozen=True)
class ServedServer:
    """A running server the doctor started: its base URL, argv and process id."""

    base_url: str
    argv: tuple[str, ...]
    pid: int

    @property
    def pids(self) -> tuple[int, ...]:
        """The server and its children (the engine core), for the resource meter."""
        return server_tree(self.pid)


def parse_command(command: str) -> list[str]:
    """Split a --serve command line; DoctorInputError when it is empty or cannot be parsed."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise DoctorInputError(f"--serve: cannot parse {command!r}: {exc}") from exc
    if not argv:
        raise DoctorInputError('--serve needs a command, e.g. --serve "kvpilot serve --max-num-seqs 8"')
    return argv


def engine_of(argv: list[str]) -> str:
    """The engine a command starts (kvpilot.doctor.engines' names), so verify applies fixes as its flags:
    ``vllm serve``, ``llama-server``, SGLang's ``launch_server`` / ``sglang serve``, TGI's
    ``text-generation-launcher``; anything else is kvpilot's. A leading ``env NAME=VALUE ...`` (vLLM's CPU build
    is configured by environment variables) is looked past."""
    if argv and os.path.basename(argv[0]) == "env":
        argv = [arg for arg in argv[1:] if "=" not in arg or arg.startswith("-")]
    if not argv:
        return KVPILOT
    program, head = os.path.basename(argv[0]), " ".join(argv[:3])
    if program == "vllm" or "vllm.entrypoints" in head:
        return VLLM
    if program == "llama-server":
        return LLAMACPP
    if program == "sglang" or "sglang.launch_server" in head:
        return SGLANG
    if program == "text-generation-launcher":
        return TGI
    return KVPILOT


def resolve(argv: list[str]) -> list[str]:
    """``kvpilot ...`` runs with this interpreter when no ``kvpilot`` is on PATH (a virtual environment
    that is not activated): the doctor and the server it starts are then the same installation."""
    if argv[0] == "kvpilot" and shutil.which("kvpilot") is None:
        return [sys.executable, "-m", "kvpilot.cli", *argv[1:]]
    return argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_port(argv: list[str]) -> tuple[list[str], int]:
    """The command with a --port (a free one unless it names one) and --host 127.0.0.1 unless given."""
    out = list(argv)
    port = None
    for i, arg in enumerate(out):
        if arg == "--port" and i + 1 < len(out):
            port = int(out[i + 1])
        elif arg.startswith("--port="):
            port = int(arg.split("=", 1)[1])
    if port is None:
        port = _free_port()
        out += ["--port", str(port)]
    return out, port


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            lines = [ln.strip() for ln in fh.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def _ready(url: str) -> bool:
    """GET /health says 200 (kvpilot and vLLM: the model is loaded) and /v1/models answers; a server
    without /health (404) is ready when /v1/models answers."""
    try:
        health = httpx.get(url + "/health", timeout=2.0).status_code
        return health in (200, 404) and httpx.get(url + "/v1/models", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise DoctorInputError(f"--serve command exited with code {code} before serving: {_last_line(log)}")
        if _ready(url):
            return
        time.sleep(0.5)
    raise DoctorInputError(f"--serve command did not answer GET /v1/models within {timeout_s:.0f} s "
                           f"(last log line: {_last_line(log)}); raise --serve-timeout")


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM to the server's own process group, SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@contextlib.contextmanager
def served(argv: list[str], timeout_s: float = 300.0) -> Iterator[ServedServer]:
    """Run ``argv`` until the block ends; raises DoctorInputError when it does not come up."""
    argv, port = with_port(resolve(argv))
    log = tempfile.NamedTemporaryFile(prefix="kvpilot-doctor-serve-", suffix=".log", delete=False)
    try:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as exc:
        log.close()
        os.unlink(log.name)
        raise DoctorInputError(f"--serve: cannot run {argv[0]!r}: {exc.strerror or exc}") from exc
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(proc, url, log.name, timeout_s)
        yield ServedServer(url, tuple(argv), proc.pid)
    finally:
        _stop(proc)
        log.close()
        os.unlink(log.name)
