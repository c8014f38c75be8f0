from __future__ import annotations

import pytest

from kvpilot.fit.errors import FitError
from kvpilot.fit.model_source import load_model
from kvpilot.fit.weight_formats import compute_dtype, kv_dtype_bytes, weight_format


def test_formats_bits() -> None:
    spec = load_model("llama-3.1-8b").spec
    assert weight_format("fp32", spec).bits_linear == 32
    assert weight_format("bfloat16", spec).name == "bf16"
    int4 = weight_format("int4", spec)
    assert int4.bits_linear == 4 + 20 / 128 and int4.bits_embedding == 16
    assert weight_format("fp8", spec).bits_embedding == 16
    q4_1 = weight_format("Q4_1", spec)  # 32 weights in 20 bytes: fp16 scale + fp16 min + 16 bytes of nibbles
    assert q4_1.bits_linear == 5.0 and q4_1.bits_vector == 32


def test_auto_follows_the_checkpoint() -> None:
    assert weight_format("auto", load_model("deepseek-v3").spec).name == "fp8"
    assert weight_format("auto", load_model("llama-3.1-8b").spec).name == "bf16"


def test_unknown_format_suggests() -> None:
    with pytest.raises(FitError, match="Did you mean: int8, int4"):
        weight_format("int5", load_model("llama-3.1-8b").spec)


def test_kv_dtype_bytes() -> None:
    spec = load_model("llama-3.1-8b").spec
    assert kv_dtype_bytes("auto", spec) == 2
    assert kv_dtype_bytes("fp8", spec) == kv_dtype_bytes("fp8_e5m2", spec) == 1
    assert kv_dtype_bytes("auto", spec, dtype="fp32") == 4
    with pytest.raises(FitError, match="kv cache dtype"):
        kv_dtype_bytes("int3", spec)


def test_fp32_checkpoints_run_in_bf16_by_default() -> None:
    from dataclasses import replace

    spec = replace(load_model("smollm2-135m").spec, torch_dtype="float32")
    assert compute_dtype(spec) == "bf16"
    assert compute_dtype(spec, "fp32") == "fp32"
