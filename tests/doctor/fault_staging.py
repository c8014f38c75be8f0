"""Faults staged around a server rather than inside it, shared by the doctor's live tests and
benchmarks/doctor_matrix.py (which imports this module with the repository root on sys.path).

Each one is something a real deployment gets wrong outside the engine's code: a network hop that delays
every byte (:class:`DelayProxy`), other processes spinning on the server's cores (:func:`spinners`), a load
generator whose event loop shares its GIL with CPU-bound work (:func:`gil_hog`, :data:`HOGGED_CLI`), and other
users' traffic beside the doctor's probe (:func:`background_load`, run as ``python -m
tests.doctor.fault_staging load ...``). Only the standard library and httpx are imported: a benchmark that
never loads kvpilot's engine can use it, and so can the bench worker process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that delivers every chunk ``delay_s`` late in each direction (order
    kept), like a gateway on a long network path. Runs its own event loop in a daemon thread."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port, self.delay_s = upstream_port, delay_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="delay-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - self._loop.time()))
                dst.write(data)
                await dst.drain()
            dst.close()

        sender = asyncio.create_task(deliver())
        try:
            while data := await src.read(65536):
                queue.put_nowait((self._loop.time() + self.delay_s, data))
        except ConnectionError:
            pass
        queue.put_nowait(None)
        with contextlib.suppress(ConnectionError):
            await sender

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> asyncio.AbstractServer:
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            return server

        self._server = self._loop.run_until_complete(start())
        self._loop.run_forever()

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@contextlib.contextmanager
def spinners(count: int, cpus: list[int] | None = None) -> Iterator[list[int]]:
    """``count`` processes spinning on the CPU (``while True: pass``), pinned to ``cpus`` when given (with
    taskset), detached from this process (another job on the host, not a child of a server that runs in
    this process); yields their pids, killed by pid on exit."""
    pin = f"taskset -c {','.join(map(str, cpus))} " if cpus else ""
    spin = f"{pin}{shlex.quote(sys.executable)} -c 'while True: pass' >/dev/null 2>&1 & echo $!"
    pids: list[int] = []
    try:
        for _ in range(count):
            out = subprocess.run(["sh", "-c", spin], capture_output=True, text=True, check=True)
            pids.append(int(out.stdout.strip()))
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def gil_hog(switch_interval_s: float = 0.03) -> Iterator[None]:
    """A thread of this process spinning on CPU-bound Python for the whole block, with the interpreter's GIL
    switch interval set to ``switch_interval_s`` (as long-running C extensions hold it): the event loop of a
    load generator in this process then runs late by about that much at every wake-up, which is what a
    client-lag detector must catch. The interval is restored and the thread stopped on exit."""
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            sum(i * i for i in range(10_000))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_s)
    hog = threading.Thread(target=spin, name="gil-hog", daemon=True)
    hog.start()
    try:
        yield
    finally:
        done.set()
        hog.join()
        sys.setswitchinterval(interval)


@contextlib.contextmanager
def gil_stalls(stall_s: float, every_s: float = 1.0) -> Iterator[None]:
    """A thread of this process that, every ``every_s``, runs one C-level loop holding the GIL for about ``stall_s``
    (as a JSON parse of a large body or a synchronous logging call would): the event loop of a load generator in
    this process stalls that long now and then, and runs at full speed in between (unlike :func:`gil_hog`, whose
    every wake-up waits, which slows a whole probe several-fold)."""
    started = time.perf_counter()
    sum(range(1_000_000))  # calibrate: a C loop the interpreter never interrupts
    n = max(1, int(1_000_000 * stall_s / max(time.perf_counter() - started, 1e-6)))
    done = threading.Event()

    def stall() -> None:
        while not done.wait(every_s):
            sum(range(n))

    thread = threading.Thread(target=stall, name="gil-stalls", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


HOGGED_CLI = """import sys
sys.path.insert(0, {root!r})
import kvpilot.doctor.probe as probe
from kvpilot.cli import main
from tests.doctor.fault_staging import gil_stalls
{preload}
unhogged = probe.run_phase

def hogged(*args, **kwargs):
    with gil_stalls({interval!r}):
        return unhogged(*args, **kwargs)

probe.run_phase = hogged
main()
"""
"""``python -c HOGGED_CLI.format(root=..., interval=..., preload=...) doctor --url ...``: the kvpilot CLI whose probe
phases (`kvpilot.doctor.probe.run_phase`: the bench, the doctor's load generator) run beside :func:`gil_stalls` of
``interval`` s once a second: a slow client. Only the phases, and stalls rather than :func:`gil_hog`: with a hog of a
0.4 s switch interval from the start, every file read gave the GIL away for a whole interval (the doctor was still
importing its modules after 7 minutes; around the whole probe its /proc scan for the server took minutes)."""
HOG_PRELOAD = "import aiohttp, numpy, kvpilot.bench.api, kvpilot.doctor.diagnose, kvpilot.doctor.render_console"
"""Imported before the probe too (what the probe and the report might import lazily)."""


def hogged_cli(stall_s: float) -> list[str]:
    """argv prefix running the kvpilot CLI with its probe phases beside :func:`gil_stalls` of ``stall_s`` (append
    ``doctor --url ...``)."""
    return [sys.executable, "-c", HOGGED_CLI.format(root=str(REPO_ROOT), interval=stall_s, preload=HOG_PRELOAD)]


STALLED_CLI = """import sys
sys.path.insert(0, {root!r})
from kvpilot.cli import main
from tests.doctor.fault_staging import gil_stalls
with gil_stalls({interval!r}):
    main()
"""
"""The kvpilot CLI beside :func:`gil_stalls` from start to end: a slow client whose command is not the doctor (the
`kvpilot bench` that feeds the peer doctors of benchmarks/doctor_peers.py)."""


def stalled_cli(stall_s: float) -> list[str]:
    """argv prefix running the whole kvpilot CLI beside :func:`gil_stalls` of ``stall_s`` (append ``bench ...``)."""
    return [sys.executable, "-c", STALLED_CLI.format(root=str(REPO_ROOT), interval=stall_s)]


# ---- other users' traffic beside the probe -------------------------------------------------------------------

WORDS = ("the of and to in is was for on that with as by at from it his an were are which this be or had not but "
         "first one their its new after who they have her she two been other when there all during into school "
         "time may years more most only over city some world would where later up such used").split()
"""Common words: SmolLM2's tokenizer encodes each as one token (as kvpilot bench's fallback tokenizer assumes)."""


def background_load_command(url: str, concurrency: int, prompt_words: int, max_tokens: int,
                            pause_s: float = 0.0) -> list[str]:
    """The argv of a :func:`background_load` process (run it with the repository root importable)."""
    return [sys.executable, "-m", "tests.doctor.fault_staging", "load", "--url", url, "--concurrency", str(concurrency),
            "--prompt-words", str(prompt_words), "--max-tokens", str(max_tokens), "--pause-s", str(pause_s)]


def _served_model(client: object, url: str, stop: threading.Event) -> str:
    """The first model of ``/v1/models``, waiting for the server (it may be starting or restarting)."""
    while not stop.is_set():
        with contextlib.suppress(Exception):
            return str(client.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])  # type: ignore[attr-defined]
        stop.wait(1.0)
    return ""


def background_load(url: str, concurrency: int, prompt_words: int, max_tokens: int, pause_s: float,
                    stop: threading.Event) -> dict[str, int]:
    """Closed-loop completions from ``concurrency`` threads until ``stop``: prompts of ``prompt_words`` random
    common words, exactly ``max_tokens`` out (ignore_eos), ``pause_s`` between a thread's requests. A refused
    or failed request is retried after a pause (0.2 s after an HTTP 429, 1 s otherwise), so a server that
    restarts (`kvpilot doctor --serve --verify`) gets the same load back. Returns {ok, failed, refused}."""
    import httpx  # noqa: PLC0415 (only the load process needs it)

    counts = {"ok": 0, "failed": 0, "refused": 0}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=600) as client:
            model = _served_model(client, url, stop)
            while not stop.is_set():
                body = {"model": model, "prompt": " ".join(rng.choices(WORDS, k=prompt_words)),
                        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
                try:
                    status = client.post(f"{url}/v1/completions", json=body).status_code
                except httpx.HTTPError:
                    status = 0
                key = "ok" if status == 200 else "refused" if status == 429 else "failed"
                with lock:
                    counts[key] += 1
                stop.wait(pause_s if key == "ok" else 0.2 if key == "refused" else 1.0)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    while not stop.wait(0.5):  # a timed wait: the signal handler that sets `stop` runs on this thread
        pass
    deadline = time.monotonic() + 2.0  # requests still in flight are abandoned (daemon threads)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        return dict(counts)


def _load_main(argv: list[str]) -> None:
    """``python -m tests.doctor.fault_staging load ...``: runs until SIGTERM/SIGINT, then prints its counts."""
    parser = argparse.ArgumentParser(prog="fault_staging load")
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--prompt-words", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--pause-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    counts = background_load(args.url.rstrip("/"), args.concurrency, args.prompt_words, args.max_tokens,
                             args.pause_s, stop)
    print(f"background load: {counts['ok']} ok, {counts['refused']} refused (429), {counts['failed']} failed "
          f"in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["load"]:
        sys.exit("usage: python -m tests.doctor.fault_staging load --url URL --concurrency N --prompt-words W "
                 "--max-tokens T [--pause-s S]")
    _load_main(sys.argv[2:])
