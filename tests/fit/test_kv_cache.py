from __future__ import annotations

import pytest

from kvpilot.fit.kv_cache import (
    KvCapacity,
    format_capacity_line,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_cache_bytes_per_block,
    kv_capacity_for_memory,
    num_kv_blocks_for_memory,
)
from kvpilot.fit.model_source import load_model


def test_llama_3_1_kv_bytes_per_token_by_hand() -> None:
    # 2 (K and V) x layers x kv_heads x head_dim x 2 bytes
    assert kv_bytes_per_token(load_model("llama-3.1-8b").spec, 2) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_bytes_per_token(load_model("llama-3.1-70b").spec, 2) == 2 * 80 * 8 * 128 * 2 == 327_680


def test_deepseek_v3_kv_is_the_mla_latent() -> None:
    spec = load_model("deepseek-v3").spec
    # (kv_lora_rank 512 + rope key 64) per layer, 61 layers, bf16; no separate V, not per head
    assert kv_bytes_per_token(spec, 2) == (512 + 64) * 61 * 2 == 70_272
    assert kv_bytes_per_token(spec, 2, tensor_parallel_size=8) == 70_272  # latent replicated on every GPU


def test_fp8_kv_halves_the_bytes() -> None:
    spec = load_model("llama-3.1-8b").spec
    assert kv_bytes_per_token(spec, 1) * 2 == kv_bytes_per_token(spec, 2)


def test_tensor_parallel_splits_kv_heads_and_replicates_beyond_them() -> None:
    spec = load_model("qwen3-30b-a3b").spec  # 4 KV heads
    one = kv_bytes_per_token(spec, 2)
    assert kv_bytes_per_token(spec, 2, 2) == one // 2
    assert kv_bytes_per_token(spec, 2, 4) == one // 4
    assert kv_bytes_per_token(spec, 2, 8) == one // 4  # 1 head per GPU, replicated


def test_a_sliding_window_caps_per_sequence_bytes_when_every_layer_slides() -> None:
    spec = load_model("mistral-7b-v0.1").spec  # 32 layers, all sliding over 4096 tokens
    per_layer = 2 * 8 * 128 * 2
    assert kv_bytes_per_sequence(spec, 8192, 2) == 32 * 4096 * per_layer
    assert kv_bytes_per_sequence(spec, 1000, 2) == 32 * 1000 * per_layer
    # paged: whole blocks, and the window keeps one extra partly used block (the engine's KV manager's bound)
    assert kv_bytes_per_sequence(spec, 8192, 2, block_size=16) == 32 * (4096 + 16) * per_layer


def test_interleaved_sliding_layers_hold_only_their_window() -> None:
    spec = load_model("gemma-2-9b").spec  # 42 layers, 21 sliding with a 4096 window
    per_layer = 2 * 8 * 256 * 2
    # the engine's KV groups: the 21 full layers keep every token, the 21 sliding ones their window's blocks
    assert kv_bytes_per_sequence(spec, 8192, 2, block_size=16) == (21 * 8192 + 21 * 4096 + 21 * 16) * per_layer
    assert kv_bytes_per_sequence(spec, 2048, 2, block_size=16) == 42 * 2048 * per_layer  # inside the window


def test_engine_block_bytes_by_hand() -> None:
    spec = load_model("smollm2-135m").spec
    assert kv_cache_bytes_per_block(spec, 16, 2) == 2 * 30 * 16 * 3 * 64 * 2 == 368_640
    assert kv_cache_bytes_per_block(spec, 16, 2) == 16 * kv_bytes_per_token(spec, 2)


def test_num_blocks_is_the_floor_of_budget_over_block_bytes() -> None:
    spec = load_model("smollm2-135m").spec
    assert num_kv_blocks_for_memory(spec, 368_640 * 10 - 1, 16, 2) == 9
    assert num_kv_blocks_for_memory(spec, 368_640 * 10, 16, 2) == 10
    assert num_kv_blocks_for_memory(spec, -5, 16, 2) == 0
    with pytest.raises(ValueError, match="block_size"):
        kv_cache_bytes_per_block(spec, 0, 2)


def test_capacity_and_its_startup_line() -> None:
    spec = load_model("smollm2-135m").spec
    capacity = kv_capacity_for_memory(spec, 2**30, 16, 2, 8192)
    assert capacity.num_blocks == 2**30 // 368_640 == 2912
    assert capacity.num_tokens == 2912 * 16
    assert capacity.max_concurrency == pytest.approx(2912 / 512)
    line = format_capacity_line(capacity)
    assert line.startswith("KV cache: 2,912 blocks x 16 = 46,592 tokens (")
    assert "maximum concurrency for 8,192 tokens per request: 5.69x" in line


def test_capacity_json_round_trip_fields() -> None:
    capacity = KvCapacity(num_blocks=100, block_size=16, bytes_per_block=1000, max_model_len=800)
    data = capacity.to_json()
    assert data["num_tokens"] == 1600 and data["num_bytes"] == 100_000 and data["max_concurrency"] == 2.0
