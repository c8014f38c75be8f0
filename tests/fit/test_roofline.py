from __future__ import annotations

import pytest

from kvpilot.fit.hardware import parse_device_arg
from kvpilot.fit.memory import plan_memory
from kvpilot.fit.model_source import load_model
from kvpilot.fit.roofline import (
    compute_bound_batch,
    decode_point,
    flops_per_token,
    prefill_seconds,
    roofline,
    weights_read_bytes,
)
from kvpilot.fit.workload import FitInputs


def _setup(name: str, device: str, inputs: FitInputs | None = None):
    model, group = load_model(name), parse_device_arg(device)
    return model, group, plan_memory(model, group, inputs or FitInputs())


def test_llama_8b_batch_one_decode_bound_by_hand() -> None:
    model, group, plan = _setup("llama-3.1-8b", "h100-sxm")
    embedding = 128256 * 4096 * 2  # input embedding rows are gathered, not streamed
    weights = 2 * 8_030_261_248 - embedding
    kv = 1000 * 131_072
    point = decode_point(model, group, plan, batch=1, context=1000)
    assert weights_read_bytes(model, plan, 1) == weights
    assert point.memory_seconds == pytest.approx((weights + kv) / 3.35e12)
    assert point.bound == "memory bandwidth"
    assert point.tokens_per_s_per_sequence == pytest.approx(3.35e12 / (weights + kv))


def test_flops_per_token_by_hand() -> None:
    model = load_model("llama-3.1-8b")
    matrix = 8_030_261_248 - 128256 * 4096 - model.params.num_vector  # lm_head multiplies, embedding is a lookup
    attention = 2 * 32 * 32 * 1000 * (128 + 128)  # QK^T and PV over 1000 tokens, 32 heads, 32 layers
    assert flops_per_token(model, 1000) == 2 * matrix + attention


def test_aggregate_is_batch_times_per_sequence() -> None:
    model, group, plan = _setup("llama-3.1-70b", "h100-sxm:2")
    point = decode_point(model, group, plan, 32, 1152)
    assert point.tokens_per_s_aggregate == pytest.approx(32 * point.tokens_per_s_per_sequence)


def test_compute_bound_batch_is_the_crossover() -> None:
    model, group, plan = _setup("llama-3.1-70b", "h100-sxm:2")
    b = compute_bound_batch(model, group, plan, 1152)
    assert b is not None and b > 1
    before, at = decode_point(model, group, plan, b - 1, 1152), decode_point(model, group, plan, b, 1152)
    assert before.compute_seconds < before.memory_seconds
    assert at.compute_seconds >= at.memory_seconds


def test_gqa_8b_at_long_context_never_turns_compute_bound() -> None:
    # per sequence: ~15 GFLOP vs ~150 MB of KV per token at 1152 context -> 100 FLOP/byte < H100's ~295
    model, group, plan = _setup("llama-3.1-8b", "h100-sxm")
    assert compute_bound_batch(model, group, plan, 1152) is None


def test_moe_reads_few_experts_at_batch_one_and_almost_all_at_large_batch() -> None:
    model, _, plan = _setup("qwen3-30b-a3b", "h100-sxm")
    one, many = weights_read_bytes(model, plan, 1), weights_read_bytes(model, plan, 4096)
    assert one < 0.2 * plan.weights.num_bytes
    assert many == pytest.approx(plan.weights.num_bytes - plan.weights.num_bytes_embedding, rel=1e-6)


def test_prefill_on_cpu_is_compute_bound_and_ttft_grows_with_the_prompt() -> None:
    model, group, plan = _setup("smollm2-135m", "cpu")
    short, long = prefill_seconds(model, group, plan, 256), prefill_seconds(model, group, plan, 1024)
    assert long > 4 * short * 0.99
    assert short > weights_read_bytes(model, plan, 256) / 25e9  # compute, not the weight read, bounds it


def test_cost_per_million_tokens() -> None:
    inputs = FitInputs(price_per_hour=3.0, concurrency=8)
    model, group, plan = _setup("llama-3.1-8b", "h100-sxm:2", inputs)
    rl = roofline(model, group, plan, inputs.input_len, inputs.output_len, inputs.concurrency, inputs.price_per_hour)
    tokens_per_hour = rl.decode_at_concurrency.tokens_per_s_aggregate * 3600
    assert rl.cost_per_million_output_tokens == pytest.approx(3.0 * 2 / tokens_per_hour * 1e6)
    assert rl.decode_at_concurrency.batch_size == 8


def test_fp8_weights_use_fp8_tensor_cores_where_present() -> None:
    fp8 = FitInputs(weight_dtype="fp8")
    model, group, plan = _setup("llama-3.1-8b", "h100-sxm", fp8)
    rl = roofline(model, group, plan, 1024, 256, 16, None)
    assert rl.peak_flops == 1979e12
    model, group, plan = _setup("llama-3.1-8b", "a100-80gb", fp8)
    assert roofline(model, group, plan, 1024, 256, 16, None).peak_flops == 312e12
