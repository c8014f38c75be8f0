"""The scripted server in its own process, driven over HTTP (tests/bench, tests/doctor).

In-process (thread) servers share the GIL with the client, which inflates measured latencies;
a separate process keeps client-side numbers close to the scripted truth. The child runs
``python -m tests.doubles.scripted_process`` with the repository root as its working directory, so it
works from a fresh clone where tests/ is not installed, whatever directory pytest was started from.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tests.doubles.scripted_server import Behavior, Script, ServedRequest, build_app, cycled

REPO_ROOT = Path(__file__).resolve().parents[2]  # holds the `tests` package


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ScriptedProcess:
    """Starts ``python -m tests.doubles.scripted_process --port P`` on 127.0.0.1.

    :meth:`set_script` installs behaviors (cycled by request index) and clears the log;
    :meth:`served` returns the server-side log (arrival times on the server's perf_counter).
    """

    def __init__(self, model: str = "scripted-model", start_timeout_s: float = 30.0) -> None:
        self.model, self.start_timeout_s = model, start_timeout_s
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ScriptedProcess:
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.doubles.scripted_process",
                                       "--port", str(self.port), "--model", self.model], cwd=REPO_ROOT)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                httpx.get(self.base_url + "/v1/models", timeout=1.0).raise_for_status()
                return self
            except httpx.HTTPError:
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"scripted server on port {self.port} did not start") from None
                time.sleep(0.1)

    def set_script(self, *behaviors: Behavior, max_running: int | None = None) -> None:
        body = {"behaviors": [dataclasses.asdict(b) for b in behaviors], "max_running": max_running}
        httpx.post(self.base_url + "/_control/script", json=body, timeout=5.0).raise_for_status()

    def served(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.base_url + "/_control/log", timeout=5.0).json())

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> ScriptedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    """Serve the scripted app on 127.0.0.1:PORT with the /_control endpoints enabled."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="scripted-model")
    args = parser.parse_args()
    holder: dict[str, Script] = {"script": cycled((Behavior(),))}
    log: list[ServedRequest] = []
    app = build_app(lambda i, body: holder["script"](i, body), args.model, log,
                    control=lambda bs: holder.update(script=cycled(bs)))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="critical", lifespan="off")


if __name__ == "__main__":
    main()
