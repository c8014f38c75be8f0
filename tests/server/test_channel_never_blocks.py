"""The channel between the HTTP process and the engine core process never deadlocks, and neither process ever
blocks on its own output (issue 43, item 0).

- Two PipeEndpoints over real OS pipes send each other messages far larger than a pipe holds, from one thread
  each, before either reads: a blocking write would wait forever for a peer that is itself writing.
- A message still arriving stays in the reader's buffer (read_ready never waits for the rest).
- A peer that stops reading shows as a stall in the watchdog (named in /health), which ends when it reads.
- A message over the size limit is refused before anything is written.
- A process whose stderr is a pipe nobody reads keeps logging (detach_output), where it used to block in
  write() for good; and a real `kvpilot serve` with both outputs unread keeps answering /health while it
  serves requests that log long access lines.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import Pipe
from pathlib import Path

import httpx
import pytest

from kvpilot.server.background import free_port
from kvpilot.server.core.pipe_channel import ChannelWatchdog, MessageTooLargeError, PipeEndpoint
from tests.server.tiny_server import write_tiny_config

BIG = 4 * 1024 * 1024  # 4x the widened pipe, 64x the default one


@pytest.fixture()
def pair() -> Iterator[tuple[PipeEndpoint, PipeEndpoint]]:
    a_reads, b_writes = Pipe(duplex=False)
    b_reads, a_writes = Pipe(duplex=False)
    a = PipeEndpoint(a_reads, a_writes, "to b")
    b = PipeEndpoint(b_reads, b_writes, "to a")
    yield a, b
    a.close()
    b.close()


def _read_all(endpoint: PipeEndpoint, count: int, timeout_s: float = 30.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {len(got)} of {count} messages arrived"
        messages, eof = endpoint.read_ready()
        assert not eof
        got.extend(messages)
        time.sleep(0.001)
    return got


@pytest.mark.timeout(60)
def test_both_sides_send_far_more_than_a_pipe_holds_before_either_reads(pair) -> None:
    a, b = pair
    started = time.monotonic()
    for i in range(5):  # one thread: with blocking writes the first send would never return
        a.send(("from a", i, b"a" * BIG))
        b.send(("from b", i, b"b" * BIG))
    assert time.monotonic() - started < 5.0
    to_b = _read_all(b, 5)
    to_a = [a.recv() for _ in range(5)]  # the core's way: blocking reads of whole messages
    assert [(m[0], m[1], len(m[2])) for m in to_b] == [("from a", i, BIG) for i in range(5)]
    assert [(m[0], m[1], len(m[2])) for m in to_a] == [("from b", i, BIG) for i in range(5)]


def test_a_message_still_arriving_waits_in_the_buffer(pair) -> None:
    a, b = pair
    a.send(b"x" * BIG)
    pieces: list = []
    deadline = time.monotonic() + 30
    num_calls = 0
    while not pieces:
        assert time.monotonic() < deadline
        messages, _ = b.read_ready(max_bytes=256 * 1024)  # a quarter of a pipe a call: many partial reads
        pieces.extend(messages)
        num_calls += 1
    assert pieces == [b"x" * BIG]
    assert num_calls >= 2  # returned nothing until the last piece arrived


def test_a_peer_that_stops_reading_is_named_as_a_stall_until_it_reads(pair) -> None:
    a, b = pair
    watchdog = ChannelWatchdog(a, stall_after_s=0.3)
    try:
        a.send(b"x" * BIG)  # the pipe fills; nothing reads b
        deadline = time.monotonic() + 10
        while not watchdog.stalled:
            assert time.monotonic() < deadline, "the watchdog never saw the stall"
            time.sleep(0.05)
        assert "the channel to b has not moved for" in watchdog.describe()
        assert a.stalled_s() > 0.3
        assert _read_all(b, 1) == [b"x" * BIG]
        deadline = time.monotonic() + 10
        while watchdog.stalled:
            assert time.monotonic() < deadline, "the stall never cleared after the peer read"
            time.sleep(0.05)
        assert a.stalled_s() == 0.0
    finally:
        watchdog.stop()


def test_a_message_over_the_limit_is_refused_and_the_channel_goes_on(pair) -> None:
    a, b = pair
    a.max_message_bytes = 64 * 1024
    with pytest.raises(MessageTooLargeError, match=r"MiB limit of the channel to b"):
        a.send(b"x" * 100_000)
    a.send("small")
    assert _read_all(b, 1) == ["small"]


_LOGS_INTO_AN_UNREAD_PIPE = """
import logging, sys, time
logging.basicConfig(level=logging.INFO)
from kvpilot.server.observe.log_writer import detach_output
detach_output()
started = time.monotonic()
for i in range(2000):
    logging.getLogger("kvpilot.test").info("line %d %s", i, "x" * 1000)  # 2 MB: 32 pipes' worth
    print("printed", i)
with open(sys.argv[1], "w") as out:
    out.write(str(time.monotonic() - started))
"""


@pytest.mark.timeout(60)
def test_logging_into_a_pipe_nobody_reads_never_blocks(tmp_path: Path) -> None:
    done = tmp_path / "done"
    child = subprocess.Popen([sys.executable, "-c", _LOGS_INTO_AN_UNREAD_PIPE, str(done)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not done.exists():
            assert time.monotonic() < deadline, "the logging loop blocked on its full stderr pipe"
            time.sleep(0.05)
        assert float(done.read_text() or "0") < 20
    finally:
        child.kill()
        child.wait()


def _health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            started = time.monotonic()
            assert client.get(f"{url}/health").status_code == 200
            out.append(time.monotonic() - started)
            time.sleep(0.02)


@pytest.mark.timeout(300)
def test_a_server_whose_outputs_nobody_reads_keeps_serving(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kvpilot.server", "--model", str(write_tiny_config(tmp_path, narrow=True)),
               "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "2048",
               "--kv-cache-memory", "64MiB", "--port", str(port), "--served-model-name", "tiny", "--log-prompts"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # never read
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the server never became healthy"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        latencies: list[float] = []
        stop = threading.Event()
        watcher = threading.Thread(target=_health_latencies, args=(url, stop, latencies))
        watcher.start()
        prompt = "the quick brown fox jumps over the lazy dog " * 160  # ~7 KB an access-log line
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(40):  # ~280 KB of access log: the 64 KiB pipe filled several times over
                assert client.post("/v1/completions", json=body).status_code == 200
            big_choice = {"model": "tiny", "prompt": "pick", "max_tokens": 4,
                          "guided_choice": [f"choice number {i}" for i in range(10_000)]}
            assert client.post("/v1/completions", content=json.dumps(big_choice),
                               headers={"Content-Type": "application/json"}).status_code < 500
            assert client.post("/v1/completions", json=body).status_code == 200
        stop.set()
        watcher.join(30)
        assert len(latencies) > 10
        assert max(latencies) < 2.0, f"/health waited {max(latencies):.2f} s"
        assert statistics.quantiles(latencies, n=10)[-1] < 0.1, sorted(latencies)[-10:]
    finally:
        server.kill()
        server.wait(30)


@pytest.fixture()
def stoppable_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """A server whose core is its own process (a 2-layer dummy model, no tokenizer: token-id prompts) and
    whose watchdog calls a channel stalled after 1 s."""
    from kvpilot.launch.args import EngineArgs
    from kvpilot.fit.model_catalog import get_hf_config
    from kvpilot.server import ServerArgs, create_app, engine_factory
    from kvpilot.server.background import BackgroundServer

    monkeypatch.setattr("kvpilot.server.core.pipe_channel.STALL_AFTER_S", 1.0)
    config = get_hf_config("smollm2-135m")
    config.update(num_hidden_layers=2, vocab_size=4096)
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = EngineArgs(model=str(tmp_path / "config.json"), load_format="dummy", dtype="float32",
                      max_model_len=256, kv_cache_memory="16MiB")
    app = create_app(engine_factory(args), ServerArgs(served_model_names=("tiny",)))
    with BackgroundServer(app, timeout_s=60) as server:
        yield server


@pytest.mark.timeout(120)
def test_a_core_that_stops_reading_shows_in_health_and_recovers(stoppable_core) -> None:
    import os
    import signal

    pid = stoppable_core.state.client.core_pid
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0,
            "logit_bias": {str(t): 0.5 for t in range(4096)}}  # ~60 KB an AddRequest: 30 fill the pipe
    statuses: list[int] = []

    def post() -> None:
        statuses.append(httpx.post(f"{stoppable_core.url}/v1/completions", json=body, timeout=90).status_code)

    os.kill(pid, signal.SIGSTOP)
    posters = [threading.Thread(target=post) for _ in range(30)]
    try:
        for poster in posters:
            poster.start()
        deadline, health = time.monotonic() + 30, None
        while health is None or health.status_code == 200:
            assert time.monotonic() < deadline, "/health never named the stalled channel"
            time.sleep(0.2)
            health = httpx.get(f"{stoppable_core.url}/health", timeout=5)
        error = health.json()["error"]
        assert health.status_code == 503 and error["type"] == "engine_channel_stalled"
        assert "the channel to the engine core has not moved for" in error["message"]
    finally:
        os.kill(pid, signal.SIGCONT)
    for poster in posters:
        poster.join(60)
    assert statuses == [200] * 30
    deadline = time.monotonic() + 10
    while httpx.get(f"{stoppable_core.url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "/health stayed 503 after the core read again"
        time.sleep(0.2)
