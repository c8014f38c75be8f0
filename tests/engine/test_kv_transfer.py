"""Disaggregation's engine side (engine/kv_transfer.py), torch-free: kv_transfer_params parsing and role checks, a
prefill request's blocks held after it finishes (and freed exactly once), and a decode request admitted with
pulled K/V: new blocks, one KVLoad for the runner, those tokens computed, the pull consumed."""

from __future__ import annotations

import pytest

from kvpilot.engine.kv_transfer import (KVTransferParamsError, PulledKV, check_role, parse_kv_transfer_params,
                                        role_of_vllm_config)

from .engine_fakes import make_request, make_scheduler

GOOD = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h",
        "remote_port": 9000, "remote_block_ids": [3, 4], "num_remote_tokens": 7}


def test_kv_transfer_params_are_parsed_and_checked() -> None:
    assert parse_kv_transfer_params(None) is None and parse_kv_transfer_params({}) is None
    assert parse_kv_transfer_params({"do_remote_decode": True}).do_remote_decode  # type: ignore[union-attr]
    source = parse_kv_transfer_params(GOOD).source  # type: ignore[union-attr]
    assert source is not None and source.block_ids == (3, 4) and source.num_tokens == 7
    for bad, message in (([1], "must be an object"), ({"do_remote_decode": 1}, "booleans"),
                         ({"do_remote_decode": True, "do_remote_prefill": True}, "either"),
                         ({**GOOD, "remote_port": True}, "remote_port must be a int"),
                         ({**GOOD, "remote_block_ids": [1, -2]}, "remote_block_ids"),
                         ({**GOOD, "remote_request_id": None}, "remote_request_id")):
        with pytest.raises(KVTransferParamsError, match=message):
            parse_kv_transfer_params(bad)
    decode = parse_kv_transfer_params(GOOD)
    assert decode is not None
    check_role(decode, "both")
    with pytest.raises(KVTransferParamsError, match="disaggregation off"):
        check_role(decode, None)
    assert role_of_vllm_config({"kv_connector": "KvpilotConnector", "kv_role": "kv_producer", "kv_port": 7}) == \
        ("prefill", None, 7)
    with pytest.raises(KVTransferParamsError, match="KvpilotConnector or TcpConnector"):
        role_of_vllm_config({"kv_connector": "NixlConnector", "kv_role": "kv_both"})


def _run_to_end(scheduler, request) -> None:
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update_from_output(output, {c.request_id: 7 for c in output.chunks if c.needs_sample})
        scheduler.check_integrity()


def test_a_prefill_request_holds_its_blocks_until_released() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=10)
    request = make_request("p", list(range(1, 11)), max_tokens=1)
    request.hold_kv = True
    _run_to_end(scheduler, request)
    kv = scheduler.kv
    assert len(request.block_ids) == 3  # 10 prompt tokens in blocks of 4, all held
    assert kv.num_held_blocks == 3 and scheduler.make_stats().num_used_blocks == 3
    kv.check_integrity()  # held tables count in the ref counts
    assert kv.release_held("p") and not kv.release_held("p")  # freed exactly once
    assert scheduler.make_stats().num_used_blocks == 0 and kv.num_held_blocks == 0
    aborted = make_request("a", list(range(1, 11)), max_tokens=5)
    aborted.hold_kv = True
    scheduler.add_request(aborted)
    scheduler.schedule()
    scheduler.abort_requests("a")  # an aborted prefill holds nothing
    assert kv.num_held_blocks == 0 and scheduler.make_stats().num_used_blocks == 0


def test_a_decode_request_starts_from_the_pulled_kv() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=10)
    request = make_request("d", list(range(1, 11)), max_tokens=2)
    request.remote_kv = PulledKV(num_tokens=10, num_blocks=3, data=bytes(range(24)), transfer_s=0.5)
    scheduler.add_request(request)
    output = scheduler.schedule()
    (load,) = output.kv_loads
    assert load.block_ids == tuple(request.block_ids[:3]) and load.data == bytes(range(24))  # 9 tokens: 3 blocks
    (chunk,) = output.chunks
    assert (chunk.start_position, chunk.num_tokens) == (9, 1)  # the last prompt token is computed here
    assert request.remote_kv is None and request.num_cached_tokens == 9
    assert request.num_kv_transfer_tokens == 9 and request.kv_transfer_time == 0.5
    assert scheduler.kv.prefix_stats.num_hits == 0  # not a prefix-cache hit
    scheduler.update_from_output(output, {"d": 7})
    assert scheduler.schedule().kv_loads == ()


def test_llm_refuses_a_kv_role_it_could_not_serve() -> None:
    from kvpilot import LLM

    with pytest.raises(TypeError, match="--kv-role"):
        LLM(kv_role="prefill")
    with pytest.raises(TypeError, match="kvpilot serve"):
        LLM(kv_transfer_config={"kv_connector": "KvpilotConnector", "kv_role": "kv_consumer"})
