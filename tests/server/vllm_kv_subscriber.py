"""A KV-event subscriber written the way vLLM documents one (examples/online_serving/kv_events_subscriber.py):
its own copies of vLLM's msgspec types, a SUB socket for the live stream and a replay socket asked for missed
sequence numbers. Declared here, independently of kvpilot's publisher, from vLLM's current release
(vllm/distributed/kv_events.py, >= 0.26): the batch is a positional array [ts, events, data_parallel_rank],
each event a map tagged by its class name under "type".

The replay socket is a DEALER where vLLM's example has a REQ: a REQ socket takes one reply per request, and
the publisher answers with one message per buffered batch and an end marker, so a REQ reads only the first
missed batch. A DEALER sends [b"", start] (the REQ's envelope) and reads [b"", seq, payload] until the marker.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's ZmqEventPublisher.END_SEQ, sent with an empty payload


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def replay(socket: zmq.Socket, start: int, timeout_ms: int = 5000) -> list[tuple[int, bytes]]:
    """Every (seq, payload) the publisher's replay socket holds from `start` on, up to its end marker, asked
    from a DEALER `socket`. AssertionError when the marker does not come."""
    socket.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    while True:
        assert socket.poll(timeout_ms), "the replay socket sent no end marker"
        delimiter, seq, payload = socket.recv_multipart()
        assert delimiter == b""
        if seq == END_SEQ:
            assert payload == b""
            return batches
        batches.append((int.from_bytes(seq, "big"), payload))


class Subscriber:
    """Receives on a thread; `held` is the replayed set of cached hashes. Applies batches in sequence order from
    `resume_from` on: a restarted subscriber first asks the replay socket for everything since the last batch
    it saw, and a gap in the live stream (batches the PUB socket dropped, or sent before this SUB was
    connected) is filled from the replay socket before the batch after it is applied. `bind`: the subscriber
    binds `endpoint` and the publisher connects to it (llm-d's centralized mode), else it connects.
    Invariant: the seqs applied are exactly resume_from, resume_from + 1, ... (`errors` says otherwise)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str, *, bind: bool = False,
                 resume_from: int = 0, held: set[int] | None = None) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        if bind:
            self.socket.bind(endpoint)
        else:
            self.socket.connect(endpoint)
        self.replay_socket = self.context.socket(zmq.DEALER)
        self.replay_socket.connect(replay_endpoint)
        self.topic = topic.encode()
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.next_seq = resume_from
        self.held: set[int] = set(held or ())
        self.stored: list[BlockStored] = []
        self.num_removed = 0
        self.payloads: dict[int, bytes] = {}
        self.replayed: list[int] = []  # seqs applied from the replay socket, in order
        self.live: list[int] = []  # seqs applied from the SUB socket, in order
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.next_seq > 0:  # restarted: catch up from the last batch seen
                self._catch_up()
            while not self.stop.is_set():
                if not self.socket.poll(50):
                    continue
                topic, seq_bytes, payload = self.socket.recv_multipart()
                if topic != self.topic:
                    self.errors.append(f"topic {topic!r}")
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.next_seq:  # missed some: vLLM's example asks for last_seq + 1 on
                    self._catch_up()
                    if seq > self.next_seq:
                        self.errors.append(f"the replay socket did not fill the gap before {seq}")
                        return
                if seq == self.next_seq:
                    self._apply(seq, payload)
                    self.live.append(seq)
                # seq < next_seq: already applied from the replay socket
        except Exception as exc:  # noqa: BLE001 - the test reads it
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _catch_up(self) -> None:
        for seq, payload in replay(self.replay_socket, self.next_seq):
            if seq != self.next_seq:
                self.errors.append(f"replay sent {seq} where {self.next_seq} was due")
                return
            self._apply(seq, payload)
            self.replayed.append(seq)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.payloads[seq] = payload
        batch = self.decoder.decode(payload)
        if batch.data_parallel_rank != 0:
            self.errors.append(f"data_parallel_rank {batch.data_parallel_rank}")
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.medium != "GPU" or len(event.token_ids) != event.block_size * len(event.block_hashes):
                    self.errors.append(f"stored {event}")
                self.stored.append(event)
                self.held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.num_removed += len(event.block_hashes)
                self.held.difference_update(event.block_hashes)
            else:
                self.held.clear()
        self.next_seq = seq + 1

    def close(self) -> None:
        if self.context.closed:
            return
        self.stop.set()
        self.thread.join(10)
        self.socket.close(linger=0)
        self.replay_socket.close(linger=0)
        self.context.term()
