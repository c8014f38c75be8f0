"""decode-bound's "quantize the weights" fix follows what the server says its weights take (kvpilot's capacity
endpoint: `quantization`, `weight_bits`): none for weights already ~4-bit (the embedded Q4_1 GGUF), int4 for
8-bit ones on a CPU, and the flag for the server's device when nothing is known of its weights. A CPU server is
not told to turn CUDA graphs on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.findings import Fix
from kvpilot.doctor.inputs import inputs_from_documents
from kvpilot.doctor.server_config import from_capacity
from tests.doctor.scenarios import SCENARIOS


def _decode_fixes(tmp_path: Path, capacity: dict | None) -> list[Fix]:
    paths, _, model, gpu = SCENARIOS["decode-bound"](tmp_path)  # 30 ms a token, far from the roofline
    documents = [(json.loads(Path(p).read_text()), p) for p in paths]
    config = from_capacity({"num_blocks": 100, "block_size": 16, **capacity}) if capacity is not None else None
    report = diagnose(inputs_from_documents(documents, model=model, gpu=gpu, server_config=config))
    return list(next(f for f in report.findings if f.rule_id == "decode-bound").fixes)


def _quantize_fixes(tmp_path: Path, capacity: dict | None) -> list[Fix]:
    return [fix for fix in _decode_fixes(tmp_path, capacity) if "bytes per token" in fix.action]


@pytest.mark.parametrize(("capacity", "kvpilot", "vllm"), [
    (None, "--quantization fp8 (GPU) or int4 (CPU)", "--quantization fp8"),  # vLLM, or an older kvpilot
    ({"fit_device": "cpu", "quantization": "none", "weight_bits": 16}, "--quantization int4", "--quantization fp8"),
    ({"fit_device": "h100", "quantization": "none", "weight_bits": 16}, "--quantization fp8", "--quantization fp8"),
    ({"fit_device": "cpu", "quantization": "int8", "weight_bits": 8}, "--quantization int4", ""),
])
def test_the_fix_names_the_flag_for_the_servers_weights(tmp_path: Path, capacity: dict | None, kvpilot: str,
                                                         vllm: str) -> None:
    (fix,) = _quantize_fixes(tmp_path, capacity)
    assert (fix.kvpilot, fix.vllm) == (kvpilot, vllm)


@pytest.mark.parametrize("capacity", [
    {"fit_device": "cpu", "quantization": "gguf", "weight_bits": 5.74},  # the embedded Q4_1 GGUF
    {"fit_device": "cpu", "quantization": "int4", "weight_bits": 4},
    {"fit_device": "h100", "quantization": "fp8", "weight_bits": 8},  # kvpilot's narrowest on a GPU
])
def test_weights_already_as_narrow_as_they_go_get_no_quantize_fix(tmp_path: Path, capacity: dict) -> None:
    assert _quantize_fixes(tmp_path, capacity) == []


def test_a_cpu_server_is_not_told_to_turn_cuda_graphs_on(tmp_path: Path) -> None:
    def gpu_path_fixes(device: str) -> list[Fix]:
        return [fix for fix in _decode_fixes(tmp_path, {"fit_device": device}) if "CUDA graphs" in fix.action]

    assert gpu_path_fixes("cpu") == []
    (gpu_path,) = gpu_path_fixes("h100")
    assert gpu_path.kvpilot == "(drop --enforce-eager) --attention-backend auto"  # kvpilot's flags too
