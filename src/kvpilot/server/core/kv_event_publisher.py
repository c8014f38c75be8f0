"""Publishes the engine core's KV-cache events over ZMQ in vLLM's wire format (vllm/distributed/kv_events.py,
ZmqEventPublisher), so routers built for vLLM (llm-d's KV-cache manager, Dynamo's KV router) read kvpilot's
unchanged.

PUB socket, at `endpoint`: bound for a wildcard / IPv6 / ipc / inproc endpoint, else connected (vLLM's rule,
kv_events_config.endpoint_binds). Each message is three frames: the topic, an 8-byte big-endian sequence
number (0, 1, 2...: a gap means the subscriber missed batches) and a msgpack `KVEventBatch`
[ts, [event...], data_parallel_rank] (an array; data_parallel_rank is 0: kvpilot has no data parallelism).
Each event is a msgpack map tagged by its class name under "type" (vLLM dropped positional events in
vllm-project/vllm#42892), with the fields of vLLM's structs; optional fields at their default (None) are left
out, required ones are sent even when null:
  {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
   "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}
  {"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}
  {"type": "AllBlocksCleared"}
`medium` is "GPU" for the engine's own KV cache, as vLLM names its primary tier (on a CPU engine too), unless
the engine's event names another tier. kvpilot's cache is one full-attention group: group_idx 0,
kv_cache_spec_kind "full_attention", extra_keys one null per block (no LoRA, multimodal or salt keys).

Replay ROUTER socket, at `replay_endpoint` (always bound): keeps the last `buffer_steps` batches. A request is
[identity, b"", start sequence number as 8 bytes big-endian] (what a REQ socket sends, or a DEALER that sends
[b"", seq]); the reply is one message [identity, b"", seq, payload] per buffered batch with seq >= start, in
order, then the end marker [identity, b"", (-1) as 8 signed big-endian bytes, b""].

A publisher thread owns both sockets, so a slow network never stalls a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from kvpilot.engine import kv_events
from kvpilot.engine.kv_events_config import KVEventsConfig

logger = logging.getLogger("kvpilot.server")
MEDIUM = "GPU"
KV_CACHE_SPEC_KIND = "full_attention"
GROUP_IDX = 0
DATA_PARALLEL_RANK = 0
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how long the sender waits for a batch before looking at the replay socket again


# ---- vLLM's structs (vllm/distributed/kv_events.py), fields in its declaration order ------------------------
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Tagged by class name under "type"; a map, not an array (vLLM >= 0.26)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
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
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def wire_event(event: kv_events.KVCacheEvent) -> KVCacheEvent:
    """The engine's event as vLLM's GPU block pool sends one."""
    medium = getattr(event, "medium", None) or MEDIUM
    if isinstance(event, kv_events.BlockStored):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                           lora_id=None, medium=medium, lora_name=None, extra_keys=[None] * len(event.block_hashes),
                           group_idx=GROUP_IDX, kv_cache_spec_kind=KV_CACHE_SPEC_KIND)
    if isinstance(event, kv_events.BlockRemoved):
        return BlockRemoved(event.block_hashes, medium, group_idx=GROUP_IDX)
    return AllBlocksCleared()


def _open_sockets(context: zmq.Context, config: KVEventsConfig) -> tuple[zmq.Socket, zmq.Socket | None]:
    """The PUB socket (bound or connected) and the replay ROUTER (bound), or OSError naming the endpoint."""
    opened: list[zmq.Socket] = []
    endpoint = config.endpoint
    try:
        pub = context.socket(zmq.PUB)
        opened.append(pub)
        pub.set_hwm(config.hwm)
        if config.binds:
            pub.bind(endpoint)
        else:
            pub.connect(endpoint)
        replay = None
        if config.replay_endpoint is not None:
            endpoint = config.replay_endpoint
            replay = context.socket(zmq.ROUTER)
            opened.append(replay)
            # a whole buffer fits in one reply: past the default 1000 messages a ROUTER drops silently
            replay.setsockopt(zmq.SNDHWM, max(config.buffer_steps + 1, 1000))
            replay.bind(endpoint)
        return pub, replay
    except zmq.ZMQError as exc:
        for socket in opened:
            socket.close(linger=0)
        raise OSError(f"cannot publish KV events at {endpoint!r} ({exc}): choose another kv_events_config "
                      f"{'endpoint' if endpoint == config.endpoint else 'replay_endpoint'}") from exc


class ZmqKVEventPublisher:
    """Invariants: batches are sent in publish() order with consecutive sequence numbers; the sockets are bound
    or connected before the constructor returns (a bad endpoint raises here, at start-up); the replay buffer
    holds the last `buffer_steps` batches sent, byte for byte; close() sends what was queued."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[tuple[float, list[Any]] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._context = zmq.Context()
        try:
            self._pub, self._replay = _open_sockets(self._context, config)
        except OSError:
            self._context.term()
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._topic = config.topic.encode()
        self._seq = 0
        # The sockets move to the sender thread here and are used by it alone from now on.
        self._thread = threading.Thread(target=self._send_forever, name="kvpilot-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[kv_events.KVCacheEvent]) -> None:
        """Queues one batch. Waits only when max_queue_size batches are already waiting (as vLLM does); drops
        the batch when the sender thread has stopped."""
        if not events:
            return
        item = (time.time(), [wire_event(e) for e in events])
        while self._thread.is_alive():
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    @property
    def num_sent(self) -> int:
        """Batches sent so far: the next batch's sequence number."""
        return self._seq

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(5)

    def _send_forever(self) -> None:
        try:
            while (item := self._next_batch()) is not None:
                ts, events = item
                payload = self._encoder.encode(KVEventBatch(ts, events, DATA_PARALLEL_RANK))
                self._pub.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])
                self._buffer.append((self._seq, payload))
                self._seq += 1
        except zmq.ZMQError:
            logger.exception("publishing KV events failed: no more events are sent")
        finally:
            self._pub.close(linger=1000)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._context.term()

    def _next_batch(self) -> tuple[float, list[Any]] | None:
        """The next queued batch (None: close), answering replay requests while it waits."""
        if self._replay is None:
            return self._queue.get()
        while True:
            while self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:  # a replay is best-effort: the live stream goes on
                    logger.exception("answering a KV-event replay request failed")
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # vLLM's check: [identity, delimiter, start]
            logger.warning("ignored a malformed KV-event replay request (%d frames): send the start sequence "
                           "number as 8 big-endian bytes from a REQ socket, or [b'', seq] from a DEALER",
                           len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([identity, b"", END_SEQ, b""])
