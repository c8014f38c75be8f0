"""KV-cache events through the server: a ZMQ subscriber written against vLLM's wire format (its own msgspec
types, as a router would declare them) decodes every batch, and replaying them gives the engine's own set of
cached block hashes after a mixed workload with evictions. Hashes match ones computed from the prompt alone."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
import zmq

from kvpilot.engine.block_pool import ROOT_PARENT_HASH, chained_block_hash
from kvpilot.engine.kv_events_config import KVEventsConfig
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from tests.model.reference import long_text
from tests.server.conftest import server_engine_args

MODEL = "smollm2-kv-events"
TOPIC = "kv-events"


# ---- a subscriber's view of the format: declared here, independently of kvpilot's publisher ------------------
class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """Receives on a thread; `held` is the replayed set of cached hashes, `seqs` the sequence numbers seen."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.socket.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.held: set[int] = set()
        self.stored: list[BlockStored] = []
        self.seqs: list[int] = []
        self.num_removed = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.socket.poll(50):
                continue
            topic, seq, payload = self.socket.recv_multipart()
            assert topic == TOPIC.encode()
            self.seqs.append(int.from_bytes(seq, "big"))
            for event in self.decoder.decode(payload).events:
                self._apply(event)

    def _apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            assert event.medium == "GPU" and len(event.token_ids) == event.block_size * len(event.block_hashes)
            self.stored.append(event)
            self.held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.num_removed += len(event.block_hashes)
            self.held.difference_update(event.block_hashes)
        else:
            self.held.clear()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.socket.close(linger=0)
        self.context.term()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts() -> list[str]:
    words = long_text(3).split()
    shared = " ".join(words[:60])
    return [shared + " " + " ".join(words[60 + 7 * i: 60 + 7 * i + 20]) if i % 2 else " ".join(words[5 * i: 5 * i + 90])
            for i in range(16)]


@pytest.mark.slow
def test_replayed_events_equal_the_engines_cached_blocks(llm_fp32) -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=TOPIC)
    # 32 MiB holds 44 blocks of 16 tokens (float32): 16 prompts of ~100 tokens evict each other's blocks
    spec = engine_factory(server_engine_args(kv_cache_memory="32MiB", max_model_len=256, kv_events_config=config),
                          llm_fp32.loaded, warmup=False)
    built = []

    def factory():  # the core runs in a thread here, so the test can read the engine's own pool at the end
        built.append(spec())
        return built[-1]

    app = create_app(factory, ServerArgs(served_model_names=(MODEL,)))
    subscriber = None
    try:
        with BackgroundServer(app, timeout_s=120) as server, httpx.Client(base_url=server.url, timeout=120) as http:
            subscriber = Subscriber(endpoint.replace("127.0.0.1", "localhost"))
            time.sleep(0.5)  # ZMQ's slow joiner: a subscription takes a moment to reach the publisher
            bodies = [{"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0} for p in _prompts()]
            with ThreadPoolExecutor(max_workers=4) as pool:
                assert all(r.status_code == 200 for r in pool.map(lambda b: http.post("/v1/completions", json=b),
                                                                  bodies))
            tokens = http.post("/v1/completions", json={"model": MODEL, "prompt": _prompts()[1], "max_tokens": 1,
                                                        "temperature": 0}).json()["usage"]["prompt_tokens"]
            deadline = time.monotonic() + 10
            pool_hashes = built[0].engine.scheduler.kv.pool.cached_hashes
            while subscriber.held != pool_hashes and time.monotonic() < deadline:
                time.sleep(0.05)
        assert subscriber.held == pool_hashes and pool_hashes
        assert subscriber.num_removed > 0  # blocks were evicted and reported
        assert subscriber.seqs == list(range(subscriber.seqs[0], subscriber.seqs[0] + len(subscriber.seqs)))
        prompt_ids = llm_fp32.tokenizer.encode(_prompts()[1])
        assert len(prompt_ids) == tokens
        parent = ROOT_PARENT_HASH
        first = chained_block_hash(parent, tuple(prompt_ids[:16]))
        assert any(e.parent_block_hash is None and e.block_hashes[0] == first for e in subscriber.stored)
    finally:
        if subscriber is not None:
            subscriber.close()


def test_a_bad_kv_events_config_names_the_problem() -> None:
    with pytest.raises(ValueError, match="unsupported keys"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse('{"publisher": "kafka"}')
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq"}').publishes


def test_serve_refuses_a_bad_kv_events_config_before_loading() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", "from kvpilot.cli import main; main()", "serve",
                             "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "kv_events_config.publisher must be one of null, zmq" in result.stderr
