"""decode-bound's "quantize the weights" fix names a format the running server loads, with the weight bytes it
saves: kvpilot on a CPU packed 4-bit blocks (never fp8, which a CPU dequantizes), on a GPU fp8 then an AWQ/GPTQ
int4 checkpoint (never a GGUF, which it dequantizes there); vLLM its --quantization fp8 or an int4 checkpoint;
llama.cpp a GGUF type. None for weights already about as narrow as the engine goes (the embedded Q4_1 GGUF). A
CPU server is not told to turn CUDA graphs on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.findings import Fix
from kvpilot.doctor.inputs import inputs_from_documents
from kvpilot.doctor.server_config import ServerConfig, from_capacity
from kvpilot.fit.model_source import load_model
from tests.doctor.scenarios import SCENARIOS

INT4_CHECKPOINT = "--model <an AWQ or GPTQ int4 checkpoint>"


def _decode_fixes(tmp_path: Path, capacity: dict | None, engine: str | None = None) -> list[Fix]:
    paths, _, model, gpu = SCENARIOS["decode-bound"](tmp_path)  # Llama-3.1-8B, 30 ms a token, far from the roofline
    documents = [(json.loads(Path(p).read_text()), p) for p in paths]
    config = from_capacity({"num_blocks": 100, "block_size": 16, **capacity}) if capacity is not None else None
    if engine is not None and config is None:
        config = ServerConfig(source="/metrics", engine=engine)
    report = diagnose(inputs_from_documents(documents, model=model, gpu=gpu, server_config=config, engine=engine))
    return list(next(f for f in report.findings if f.rule_id == "decode-bound").fixes)


def _quantize_fixes(tmp_path: Path, capacity: dict | None, engine: str | None = None) -> list[Fix]:
    return [fix for fix in _decode_fixes(tmp_path, capacity, engine) if "bytes per token" in fix.action]


@pytest.mark.parametrize(("capacity", "kvpilot", "vllm"), [
    (None, "--quantization fp8 (GPU) or int4 (CPU)", "--quantization fp8"),  # engine and weights unknown
    ({"fit_device": "cpu", "quantization": "none", "weight_bits": 16}, "--quantization int4", ""),
    ({"fit_device": "h100", "quantization": "none", "weight_bits": 16}, "--quantization fp8", "--quantization fp8"),
    ({"fit_device": "cpu", "quantization": "int8", "weight_bits": 8}, "--quantization int4", ""),
    ({"fit_device": "h100", "quantization": "fp8", "weight_bits": 8}, INT4_CHECKPOINT, INT4_CHECKPOINT),
])
def test_kvpilot_is_told_a_format_it_loads_on_its_device(tmp_path: Path, capacity: dict | None, kvpilot: str,
                                                           vllm: str) -> None:
    (fix,) = _quantize_fixes(tmp_path, capacity)
    assert (fix.kvpilot, fix.vllm) == (kvpilot, vllm)
    if capacity is not None and capacity["fit_device"] == "cpu":
        assert "fp8" not in fix.action + fix.kvpilot  # a CPU dequantizes fp8 weights at load
    if capacity is not None and capacity["fit_device"] != "cpu":
        assert "GGUF" not in fix.action  # kvpilot dequantizes GGUF weights on a GPU


def test_the_fix_says_how_many_bytes_a_token_it_saves(tmp_path: Path) -> None:
    (fix,) = _quantize_fixes(tmp_path, {"fit_device": "h100", "quantization": "none", "weight_bits": 16})
    params = load_model("llama-3.1-8b").params
    saved_gb = (params.num_linear_total + params.num_lm_head) * (16 - 8) / 8 / 1e9
    assert f"fp8 (8 bits): 50% fewer weight bytes a token (about {saved_gb:,.2f} GB less a token for llama-3.1-8b)" \
        in fix.action


@pytest.mark.parametrize(("engine", "action", "engine_flags"), [
    ("vllm", "fp8 (8 bits)", ""),  # vLLM's own column: --quantization fp8
    ("llama.cpp", "a Q4_K_M GGUF", ""),
    ("sglang", "fp8 (8 bits)", "--quantization fp8"),
    ("tgi", "fp8 (8 bits)", "--quantize fp8"),
])
def test_other_engines_get_a_format_they_load(tmp_path: Path, engine: str, action: str, engine_flags: str) -> None:
    (fix,) = _quantize_fixes(tmp_path, None, engine)
    assert action in fix.action and "the server does not say" in fix.action
    assert fix.engine_flags == engine_flags
    if engine == "vllm":
        assert fix.vllm == "--quantization fp8"
    if engine == "llama.cpp":  # llama-server loads GGUF files, no --quantization
        assert (fix.vllm, fix.kvpilot) == ("", "") and "fp8" not in fix.action


@pytest.mark.parametrize("capacity", [
    {"fit_device": "cpu", "quantization": "gguf", "weight_bits": 5.74},  # the embedded Q4_1 GGUF
    {"fit_device": "cpu", "quantization": "int4", "weight_bits": 5},
    {"fit_device": "h100", "quantization": "awq", "weight_bits": 4},  # an int4 checkpoint on a GPU
])
def test_weights_already_as_narrow_as_they_go_get_no_quantize_fix(tmp_path: Path, capacity: dict) -> None:
    assert _quantize_fixes(tmp_path, capacity) == []


def test_a_cpu_server_is_not_told_to_turn_cuda_graphs_on(tmp_path: Path) -> None:
    def gpu_path_fixes(device: str) -> list[Fix]:
        return [fix for fix in _decode_fixes(tmp_path, {"fit_device": device}) if "CUDA graphs" in fix.action]

    assert gpu_path_fixes("cpu") == []
    (gpu_path,) = gpu_path_fixes("h100")
    assert gpu_path.kvpilot == "(drop --enforce-eager) --attention-backend auto"  # kvpilot's flags too
