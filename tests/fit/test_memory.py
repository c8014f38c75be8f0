from __future__ import annotations

import pytest

from kvpilot.fit.errors import FitError
from kvpilot.fit.fingerprint import cpu_has_fast_bf16
from kvpilot.fit.hardware import DeviceGroup, get_gpu, parse_device_arg
from kvpilot.fit.kv_cache import kv_bytes_per_sequence
from kvpilot.fit.memory import CPU_DEFAULT_KV_CACHE_BYTES, RUNTIME_GPU_BYTES, activation_bytes, plan_memory
from kvpilot.fit.model_source import load_model
from kvpilot.fit.plan import build_report, min_devices
from kvpilot.fit.workload import FitInputs


def test_budget_identity_and_block_count() -> None:
    model = load_model("llama-3.1-8b")
    plan = plan_memory(model, parse_device_arg("h100-sxm"), FitInputs())
    assert plan.budget_bytes == int(81559 * 2**20 * 0.9)
    used = plan.weight_bytes_per_device + plan.activation_bytes + RUNTIME_GPU_BYTES
    assert plan.kv_budget_bytes == plan.budget_bytes - used
    assert plan.num_kv_blocks == plan.kv_budget_bytes // (16 * 131_072)
    assert plan.num_kv_tokens == plan.num_kv_blocks * 16


def test_cpu_plans_the_engines_default_fixed_kv_cache() -> None:
    plan = plan_memory(load_model("smollm2-135m"), parse_device_arg("cpu"), FitInputs())
    assert plan.fixed_kv_bytes == CPU_DEFAULT_KV_CACHE_BYTES == 2 * 2**30
    assert plan.kv_budget_bytes == 2 * 2**30
    kv_bytes = 2 if cpu_has_fast_bf16() else 4  # the engine's auto dtype here: bf16 or float32 K/V
    assert plan.num_kv_blocks == 2 * 2**30 // (16 * 11_520 * kv_bytes)


def test_llama_70b_bf16_needs_two_h100s() -> None:
    model = load_model("llama-3.1-70b")
    one = plan_memory(model, parse_device_arg("h100-sxm"), FitInputs())
    two = plan_memory(model, parse_device_arg("h100-sxm:2"), FitInputs())
    assert not one.weights_fit and one.num_kv_blocks == 0 and one.max_num_requests == 0
    assert two.weights_fit and two.fits_workload
    assert two.weight_bytes_per_device == -(-141_107_412_992 // 2)
    assert two.kv_bytes_per_token == 327_680 // 2  # KV heads split over 2 GPUs
    assert min_devices(model, DeviceGroup(get_gpu("h100-sxm")), FitInputs()) == 2


def test_fp8_weights_and_kv_shrink_memory() -> None:
    model = load_model("llama-3.1-70b")
    bf16 = plan_memory(model, parse_device_arg("h100-sxm:2"), FitInputs())
    fp8 = plan_memory(model, parse_device_arg("h100-sxm:2"), FitInputs(weight_dtype="fp8", kv_cache_dtype="fp8"))
    assert fp8.weights.num_bytes < 0.53 * bf16.weights.num_bytes  # linear layers at 1 byte, embeddings at 2
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.num_kv_tokens > 2 * bf16.num_kv_tokens


def test_max_requests_and_max_context_are_tight() -> None:
    model = load_model("llama-3.1-8b")
    inputs = FitInputs(concurrency=64, input_len=2000, output_len=500)
    plan = plan_memory(model, parse_device_arg("l40s"), inputs)
    per_request = kv_bytes_per_sequence(model.spec, 2500, 2, 1, 16)
    assert plan.kv_bytes_per_request == per_request
    assert plan.max_num_requests == plan.kv_budget_bytes // per_request
    n = plan.max_context_at_concurrency
    assert 64 * kv_bytes_per_sequence(model.spec, n, 2, 1, 16) <= plan.kv_budget_bytes
    assert 64 * kv_bytes_per_sequence(model.spec, n + 16, 2, 1, 16) > plan.kv_budget_bytes
    assert plan.workload_margin_bytes == plan.kv_budget_bytes - 64 * per_request


def test_fixed_kv_cache_memory_replaces_the_utilization_fraction() -> None:
    model = load_model("llama-3.1-8b")
    plan = plan_memory(model, parse_device_arg("h100-sxm"), FitInputs(kv_cache_memory_bytes=2**30))
    assert plan.kv_budget_bytes == 2**30
    assert plan.num_kv_blocks == 2**30 // (16 * 131_072)
    too_big = FitInputs(kv_cache_memory_bytes=100 * 2**30)
    report = build_report(model, parse_device_arg("h100-sxm"), too_big)
    free = 81559 * 2**20 - report.memory.weight_bytes_per_device - report.memory.activation_bytes - RUNTIME_GPU_BYTES
    assert report.memory.kv_budget_bytes == free
    assert any("exceeds the free memory" in note for note in report.notes)


def test_deepseek_v3_fp8_fits_on_eight_h200_not_eight_h100() -> None:
    model = load_model("deepseek-v3")  # checkpoint is fp8: auto weights are fp8
    h200 = plan_memory(model, parse_device_arg("h200:8"), FitInputs())
    h100 = plan_memory(model, parse_device_arg("h100-sxm:8"), FitInputs())
    assert h200.weights.format_name == "fp8"
    assert h200.fits_workload and not h100.weights_fit
    assert min_devices(model, DeviceGroup(get_gpu("h100-sxm")), FitInputs()) == 16


def test_activation_estimate_scales_with_batched_tokens() -> None:
    spec = load_model("llama-3.1-8b").spec
    small = activation_bytes(spec, FitInputs(max_num_batched_tokens=1024, max_num_seqs=1), 2, 1)
    large = activation_bytes(spec, FitInputs(max_num_batched_tokens=2048, max_num_seqs=1), 2, 1)
    logits = 1 * 128256 * 4 * 2
    assert large - logits == 2 * (small - logits)


def test_tp_must_divide_heads() -> None:
    with pytest.raises(FitError, match="divide"):
        plan_memory(load_model("llama-3.1-8b"), parse_device_arg("h100-sxm:3"), FitInputs())


def test_report_notes_explain_a_miss() -> None:
    report = build_report(load_model("llama-3.1-70b"), parse_device_arg("h100-sxm"), FitInputs())
    assert report.roofline is None and report.flags is None and report.min_devices == 2
    assert any("exceed the memory budget" in note for note in report.notes)


def test_too_long_requests_are_rejected() -> None:
    model = load_model("smollm2-135m")
    with pytest.raises(FitError, match="max_position_embeddings"):
        build_report(model, parse_device_arg("cpu"), FitInputs(max_model_len=100_000))
    with pytest.raises(FitError, match="exceeds the maximum model length"):
        build_report(model, parse_device_arg("cpu"), FitInputs(input_len=8000, output_len=500))
