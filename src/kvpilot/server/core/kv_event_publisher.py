"""Publishes the engine core's KV-cache events over ZMQ in vLLM's wire format, so routers built for vLLM
(llm-d's KV-cache indexer, Dynamo's KV router) read kvpilot's unchanged.

Each message is three frames: the topic, an 8-byte big-endian sequence number (0, 1, 2...: a gap means the
subscriber missed batches), and a msgpack `KVEventBatch` [ts, [event...]], each event an array tagged with
its type name first: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]. `medium` is "GPU" for the engine's
own KV cache, as vLLM names its primary tier (on a CPU engine too). A publisher thread owns the socket, so a
slow network never stalls a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import msgspec
import zmq

from kvpilot.engine import kv_events
from kvpilot.engine.kv_events_config import KVEventsConfig

logger = logging.getLogger("kvpilot.server")
MEDIUM = "GPU"


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Tagged by class name, like vLLM's KVCacheEvent."""


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def wire_event(event: kv_events.KVCacheEvent) -> _Event:
    if isinstance(event, kv_events.BlockStored):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, None,
                           MEDIUM)
    if isinstance(event, kv_events.BlockRemoved):
        return BlockRemoved(event.block_hashes, MEDIUM)
    return AllBlocksCleared()


class ZmqKVEventPublisher:
    """Invariants: batches are sent in publish() order with consecutive sequence numbers; the socket is bound
    before the constructor returns (a bad endpoint raises here, at start-up); close() sends what was queued."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.SimpleQueue[tuple[float, list[Any]] | None] = queue.SimpleQueue()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.set_hwm(config.hwm)
        try:
            self._socket.bind(config.endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            self._context.term()
            raise OSError(f"cannot publish KV events at {config.endpoint!r} ({exc}): choose another "
                          "kv_events_config endpoint") from exc
        self._encoder = msgspec.msgpack.Encoder()
        self._topic = config.topic.encode()
        self._seq = 0
        # The socket moves to the sender thread here and is used by it alone from now on.
        self._thread = threading.Thread(target=self._send_forever, name="kvpilot-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[kv_events.KVCacheEvent]) -> None:
        if events:
            self._queue.put((time.time(), [wire_event(e) for e in events]))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _send_forever(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                ts, events = item
                payload = self._encoder.encode(KVEventBatch(ts, events))
                self._socket.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])
                self._seq += 1
        except zmq.ZMQError:
            logger.exception("publishing KV events failed: no more events are sent")
        finally:
            self._socket.close(linger=1000)
            self._context.term()
