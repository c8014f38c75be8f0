"""kvpilot's KV-event publisher on its own (no engine): the bytes are vLLM's (a positional batch
[ts, events, data_parallel_rank] of maps tagged by "type", keys in vLLM's declaration order, optional fields
left out), the PUB socket binds or connects by endpoint as vLLM's does, and the replay ROUTER answers as
vLLM's: one [seq, payload] reply per buffered batch from the requested number on, then the end marker."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvpilot.engine import kv_events
from kvpilot.engine.kv_events_config import KVEventsConfig, endpoint_binds
from kvpilot.server.core.kv_event_publisher import ZmqKVEventPublisher
from tests.server.vllm_kv_subscriber import END_SEQ, BlockStored, KVEventBatch, replay

TOPIC = "kv@pod-a@tiny"
H1, H2 = 2**64 - 1, 12345  # block hashes are unsigned 64-bit: msgpack's uint64 form for the first


@pytest.fixture()
def publisher(tmp_path) -> Iterator[ZmqKVEventPublisher]:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub",
                            replay_endpoint=f"ipc://{tmp_path}/replay", buffer_steps=3, topic=TOPIC)
    publisher = ZmqKVEventPublisher(config)
    yield publisher
    publisher.close()


@pytest.fixture()
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _publish(publisher: ZmqKVEventPublisher, batches: list[list]) -> None:
    for events in batches:
        publisher.publish(events)
    deadline = time.monotonic() + 5
    while publisher.num_sent < len(batches) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert publisher.num_sent == len(batches)


def test_a_batch_is_vllms_positional_envelope_of_tagged_maps(publisher, context) -> None:
    sub = context.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    sub.connect(publisher.config.endpoint)
    events = [kv_events.BlockStored([H1, H2], None, [1, 2, 3, 4], 2), kv_events.BlockRemoved([H1]),
              kv_events.AllBlocksCleared(),
              kv_events.BlockStored([7], H2, [5, 6], 2, medium="CPU")]  # an offload tier's block
    frames = None
    for _ in range(100):  # ZMQ's slow joiner: what is sent before the subscription arrives is dropped
        publisher.publish(events)
        if sub.poll(50):
            frames = sub.recv_multipart()
            break
    assert frames is not None
    topic, seq, payload = frames
    assert topic == TOPIC.encode() and len(seq) == 8
    ts, wire, rank = msgspec.msgpack.decode(payload)
    assert abs(ts - time.time()) < 60 and rank == 0
    assert wire == [
        {"type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": H2, "token_ids": [5, 6],
         "block_size": 2, "lora_id": None, "medium": "CPU", "lora_name": None, "extra_keys": [None],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"}]
    # vLLM's own field order: the map keys come in its structs' declaration order
    assert list(wire[0]) == ["type", *(f for f in BlockStored.__struct_fields__ if f in wire[0])]
    typed = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    assert typed.data_parallel_rank == 0 and typed.events[0].block_hashes == [H1, H2]


def test_the_replay_socket_answers_as_vllms(publisher, context) -> None:
    _publish(publisher, [[kv_events.BlockRemoved([i])] for i in range(5)])
    dealer = context.socket(zmq.DEALER)
    dealer.connect(publisher.config.replay_endpoint)
    # buffer_steps=3: the last three batches, from the requested number on, then only the end marker
    assert [seq for seq, _ in replay(dealer, 0)] == [2, 3, 4]
    replayed = replay(dealer, 3)
    assert [seq for seq, _ in replayed] == [3, 4]
    assert [e.block_hashes for e in msgspec.msgpack.Decoder(KVEventBatch).decode(replayed[1][1]).events] == [[4]]
    assert replay(dealer, 5) == []
    # A malformed request is ignored; the socket still answers the next one.
    dealer.send_multipart([b"", b"x", b"y"])
    assert not dealer.poll(200)
    assert [seq for seq, _ in replay(dealer, 4)] == [4]
    # vLLM's example replays from a REQ socket: its one reply is [seq, payload], the first batch due.
    req = context.socket(zmq.REQ)
    req.connect(publisher.config.replay_endpoint)
    req.send((4).to_bytes(8, "big"))
    assert req.poll(5000)
    seq, payload = req.recv_multipart()
    assert int.from_bytes(seq, "big") == 4 and payload == replayed[1][1] and seq != END_SEQ


def test_the_publisher_connects_to_a_subscriber_that_binds(context) -> None:
    sub = context.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
    assert not config.binds
    publisher = ZmqKVEventPublisher(config)
    try:
        received = False
        for _ in range(100):
            publisher.publish([kv_events.AllBlocksCleared()])
            if received := sub.poll(50):
                break
        assert received and msgspec.msgpack.decode(sub.recv_multipart()[2])[1] == [{"type": "AllBlocksCleared"}]
    finally:
        publisher.close()


@pytest.mark.parametrize(("endpoint", "binds"), [
    ("tcp://*:5557", True), ("tcp://[::]:5557", True), ("ipc:///tmp/kv-events", True), ("inproc://kv", True),
    ("tcp://kv-cache-manager.llm-d.svc:5557", False), ("tcp://10.0.0.9:5557", False)])
def test_an_endpoint_binds_or_connects_as_vllm_decides(endpoint: str, binds: bool) -> None:
    assert endpoint_binds(endpoint) is binds


def test_the_publisher_defaults_to_zmq_when_events_are_enabled() -> None:
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv-events"}').publishes
    assert KVEventsConfig().publisher == "null" and not KVEventsConfig().publishes
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishes
    every_key = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://kv-manager:5557", '
        '"replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "hwm": 1000, "max_queue_size": 10, '
        '"topic": "kv@pod@model"}')
    assert not every_key.binds and every_key.replay_endpoint == "tcp://*:5558"


def test_a_busy_replay_endpoint_fails_at_start_up(context) -> None:
    taken = context.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-events-busy",
                            replay_endpoint=f"tcp://127.0.0.1:{port}")
    with pytest.raises(OSError, match="replay_endpoint"):
        ZmqKVEventPublisher(config)
