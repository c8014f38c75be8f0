"""KV-cache events through the server, read by a subscriber written the way vLLM documents one
(tests/server/vllm_kv_subscriber.py: its own copies of vLLM's msgspec types, a SUB socket and a replay socket),
in both of vLLM's socket modes: the publisher binds a wildcard endpoint and the subscriber connects, or the
subscriber binds and the publisher connects (llm-d's centralized KV-cache manager). Replaying the events gives
the engine's own set of cached block hashes after a mixed workload with evictions; hashes match ones computed
from the prompt alone. The subscriber then stops, the engine keeps publishing, and the restarted subscriber
gets exactly the batches it missed from the replay socket, in order, and nothing else."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
import zmq

from kvpilot.engine.block_pool import ROOT_PARENT_HASH, chained_block_hash
from kvpilot.engine.kv_events_config import KVEventsConfig
from kvpilot.launch.args import EngineArgs
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from kvpilot.server.core import kv_event_publisher
from tests.model.reference import long_text
from tests.server.tiny_server import write_tiny_config
from tests.server.vllm_kv_subscriber import Subscriber

MODEL = "smollm2-kv-events"
TOPIC = "kv@10.0.0.7@smollm2-kv-events"  # llm-d's topic: kv@<pod>@<model>
BLOCK_BYTES = 2 * 2 * 1 * 32 * 16 * 4  # a block of the narrow tiny model: 2 layers x (K, V) x 1 head x 32 x 16 x 4 B


class _CountingPublisher(kv_event_publisher.ZmqKVEventPublisher):
    """kvpilot's publisher, counting the batches the engine core queued (the test's view of "published")."""

    instances: list[_CountingPublisher] = []

    def __init__(self, config: KVEventsConfig) -> None:
        super().__init__(config)
        self.num_queued = 0
        self.instances.append(self)

    def publish(self, events) -> None:
        self.num_queued += bool(events)
        super().publish(events)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts() -> list[str]:
    words = long_text(3).split()
    shared = " ".join(words[:60])
    return [shared + " " + " ".join(words[60 + 7 * i: 60 + 7 * i + 20]) if i % 2 else " ".join(words[5 * i: 5 * i + 90])
            for i in range(9)]


def _wait_until(condition: Callable[[], bool], timeout_s: float = 15) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def _complete(http: httpx.Client, prompts: list[str]) -> None:
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 2, "temperature": 0} for p in prompts]
    with ThreadPoolExecutor(max_workers=4) as pool:
        assert all(r.status_code == 200 for r in pool.map(lambda b: http.post("/v1/completions", json=b), bodies))


class _Witness:
    """A plain SUB socket that never stops (bind mode only: a connecting publisher has one peer), keeping every
    payload the PUB socket sent, by sequence number."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.socket.connect(endpoint)
        self.payloads: dict[int, bytes] = {}

    def drain(self) -> dict[int, bytes]:
        while self.socket.poll(200):
            _, seq, payload = self.socket.recv_multipart()
            self.payloads[int.from_bytes(seq, "big")] = payload
        return self.payloads

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture()
def served(tmp_path, monkeypatch, request) -> Iterator[tuple[str, KVEventsConfig, list, httpx.Client]]:
    """A server publishing KV events in `request.param` mode ("bind" or "connect"): a real engine on a 2-layer
    dummy-weight SmolLM2 (the embedded tokenizer), its core in a thread (the test reads the engine's pool and
    the publisher). Yields (the subscriber's endpoint, config, [engine], client)."""
    port = _free_port()
    binds = request.param == "bind"
    endpoint = f"tcp://*:{port}" if binds else f"tcp://127.0.0.1:{port}"
    config = KVEventsConfig.parse(msgspec.json.encode({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
        "replay_endpoint": f"tcp://127.0.0.1:{_free_port()}", "buffer_steps": 1000, "topic": TOPIC}).decode())
    assert config.binds == binds
    monkeypatch.setattr(kv_event_publisher, "ZmqKVEventPublisher", _CountingPublisher)
    _CountingPublisher.instances.clear()
    # 22 blocks of 16 tokens: 4 prompts of ~100 tokens evict each other's blocks
    args = EngineArgs(model=str(write_tiny_config(tmp_path, narrow=True)), load_format="dummy", dtype="float32",
                      max_model_len=256, kv_cache_memory=f"{22 * BLOCK_BYTES}", kv_events_config=config)
    spec = engine_factory(args, warmup=False)
    built = []

    def factory():
        built.append(spec())
        return built[-1]

    app = create_app(factory, ServerArgs(served_model_names=(MODEL,), engine_process=False))
    with BackgroundServer(app, timeout_s=120) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        yield f"tcp://127.0.0.1:{port}", config, built, http


@pytest.mark.parametrize("served", ["bind", "connect"], indirect=True)
def test_a_vllm_subscriber_tracks_the_engine_and_catches_up_after_a_restart(served) -> None:
    endpoint, config, built, http = served
    publisher = _CountingPublisher.instances[0]
    pool = built[0].engine.scheduler.kv.pool
    witness = None if not config.binds else _Witness(endpoint)
    subscriber = Subscriber(endpoint, config.replay_endpoint, TOPIC, bind=not config.binds)
    restarted = None
    try:
        time.sleep(0.5)  # ZMQ's slow joiner: a subscription (or the publisher's connection) takes a moment
        _complete(http, _prompts()[:4])
        first_block = _first_block_hash(http)
        assert _wait_until(lambda: subscriber.held == pool.cached_hashes), subscriber.errors
        assert pool.cached_hashes and not subscriber.errors
        assert any(e.parent_block_hash is None and e.block_hashes[0] == first_block for e in subscriber.stored)

        # The subscriber stops; the engine publishes meanwhile (with evictions).
        last_seen, held = subscriber.next_seq - 1, set(subscriber.held)
        subscriber.close()
        _complete(http, _prompts()[4:8])
        assert _wait_until(lambda: publisher.num_sent == publisher.num_queued)
        missed = list(range(last_seen + 1, publisher.num_sent))
        assert missed

        # Restarted, it asks the replay socket for last_seen + 1 on: exactly the missed batches, in order.
        restarted = Subscriber(endpoint, config.replay_endpoint, TOPIC, bind=not config.binds,
                               resume_from=last_seen + 1, held=held)
        assert _wait_until(lambda: restarted.next_seq == publisher.num_sent), restarted.errors
        assert restarted.replayed == missed and restarted.live == [] and not restarted.errors
        assert restarted.held == pool.cached_hashes
        assert restarted.num_removed > 0  # the cache was full: the missed batches carried evictions
        if witness is not None:  # the same bytes the PUB socket sent
            assert {seq: witness.drain()[seq] for seq in missed} == {seq: restarted.payloads[seq] for seq in missed}

        # Live again: the next batch follows the last replayed one, with no gap and no second replay.
        time.sleep(0.5)
        _complete(http, _prompts()[8:])
        assert _wait_until(lambda: restarted.live and restarted.held == pool.cached_hashes), restarted.errors
        assert restarted.live[0] == missed[-1] + 1 and restarted.replayed == missed and not restarted.errors
    finally:
        for closing in (subscriber, restarted, witness):
            if closing is not None:
                closing.close()


def _first_block_hash(http: httpx.Client) -> int:
    """The hash of a prompt's first block computed from its tokens alone (the prompt is served once more, so
    the engine announces it if it was evicted); the server counts the same prompt tokens."""
    prompt = _prompts()[1]
    tokens = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                "temperature": 0}).json()["usage"]["prompt_tokens"]
    prompt_ids = http.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
    assert len(prompt_ids) == tokens
    return chained_block_hash(ROOT_PARENT_HASH, tuple(prompt_ids[:16]))


def test_a_bad_kv_events_config_names_the_problem() -> None:
    with pytest.raises(ValueError, match="unsupported keys"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "replay_endpoints": "tcp://*:5558"}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse('{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="buffer_steps must be an integer >= 0"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "buffer_steps": -1}')
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq"}').publishes


def test_serve_refuses_a_bad_kv_events_config_before_loading() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", "from kvpilot.cli import main; main()", "serve",
                             "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "kv_events_config.publisher must be one of null, zmq" in result.stderr
