"""fit's bits per weight for llama.cpp's mixes (computed from the block layouts and llama.cpp's per-tensor recipe)
and for pre-quantized HF checkpoints (from quantization_config), as kvpilot holds them on a CPU and on a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpilot.fit.gguf_mixes import file_bits_per_weight, mix_tensors
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.fit.model_source import LoadedModel, load_model
from kvpilot.fit.model_spec import spec_from_hf_config
from kvpilot.fit.params import count_params
from kvpilot.fit.weights import weight_bytes
from tests.model.kquant_gguf import tensor_type

LLAMA_2_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "vocab_size": 32000, "model_type": "llama", "tie_word_embeddings": False}


def test_q4_k_m_on_a_llama_2_7b_shape_is_its_published_4_85_bits() -> None:
    spec = spec_from_hf_config(LLAMA_2_7B, "llama-2-7b")
    tensors = {t.name: t for t in mix_tensors(spec, "q4_k_m")}
    assert file_bits_per_weight(tuple(tensors.values())) == pytest.approx(4.85, abs=0.01)
    assert (tensors["output.weight"].type_name, tensors["token_embd.weight"].type_name) == ("Q6_K", "Q4_K")
    # "more bits" layers: the first and last eighth (0-3, 28-31) and every third between (6, 9, ...)
    more = [i for i in range(32) if tensors[f"blk.{i}.attn_v.weight"].type_name == "Q6_K"]
    assert more == [0, 1, 2, 3, *range(6, 28, 3), 28, 29, 30, 31]
    assert all(tensors[f"blk.{i}.ffn_down.weight"].type_name == ("Q6_K" if i in more else "Q4_K") for i in range(32))
    assert {tensors[f"blk.{i}.attn_q.weight"].type_name for i in range(32)} == {"Q4_K"}
    assert file_bits_per_weight(mix_tensors(spec, "q8_0")) == pytest.approx(8.5, abs=0.001)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M"])
def test_mixes_agree_with_the_test_requantizer_on_the_embedded_shape(mix: str) -> None:
    """tests/model/kquant_gguf.py writes the K-quant test files by the same recipe (576-wide rows fall back)."""
    spec = load_model("smollm2-135m").spec
    for t in mix_tensors(spec, mix.lower()):
        if t.name.endswith(".weight") and t.num_rows > 1:
            assert t.type_name == tensor_type(mix, t.name, spec.num_hidden_layers, t.num_cols), t.name


def test_a_mix_is_held_packed_on_a_cpu_and_dequantized_on_a_gpu() -> None:
    model = load_model("llama-3.1-8b")
    cpu, gpu = weight_bytes(model, "q4_k_m", cpu_int8="vnni", cpu_fast_bf16=True), weight_bytes(model, "q4_k_m", on_gpu=True)
    assert cpu.format_name.startswith("q4_k_m (llama.cpp mix: 4.89 bits a weight in the file)")
    assert cpu.num_bytes_file == gpu.num_bytes_file < cpu.num_bytes < gpu.num_bytes == 2 * model.params.num_total
    # beyond the file: the 128k x 4096 embedding table dense in bf16 (4.5 bits a weight in the file), and the tiled
    # copies' byte-wide K-quant scales (at most 1/36 of a Q4_K block)
    widened = (2 - 4.5 / 8) * model.params.num_embedding
    assert widened < cpu.num_bytes - cpu.num_bytes_file < widened + cpu.num_bytes_file / 36


def _with_quantization(quantization_config: dict) -> LoadedModel:
    config = {**get_hf_config("llama-3.1-8b"), "quantization_config": quantization_config}
    spec = spec_from_hf_config(config, "llama-3.1-8b")
    return replace(load_model("llama-3.1-8b"), spec=spec, params=count_params(spec), hf_config=config)


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
CT_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}}}


@pytest.mark.parametrize(("quant", "gpu_bits", "cpu_bits"), [
    (AWQ, 4 + 20 / 128, 5.0),  # GPU: 16-bit scale + 4-bit zero a group; CPU: Q4_1 blocks of 32
    (GPTQ, 4 + 20 / 128, 4.5),  # symmetric: Q4_0 on a CPU
    ({**GPTQ, "desc_act": True}, 4 + 20 / 128, 16),  # act-order groups cut through the CPU's blocks: dequantized
    (FP8_BLOCK, 8 + 32 / 128**2, 16),  # a CPU dequantizes fp8
    (CT_INT4, 4 + 16 / 128, 4.5),  # symmetric compressed-tensors store no zero points
])
def test_checkpoint_bits_follow_its_quantization_config(quant: dict, gpu_bits: float, cpu_bits: float) -> None:
    model = _with_quantization(quant)
    p = model.params
    embeddings = 2 * (p.num_embedding + p.num_lm_head) + 2 * p.num_vector  # bf16, quantized or not
    for on_gpu, bits in ((True, gpu_bits), (False, cpu_bits)):
        held = weight_bytes(model, on_gpu=on_gpu, cpu_fast_bf16=True)  # a CPU computing in bf16
        assert held.num_bytes == pytest.approx(p.num_linear_total * bits / 8 + embeddings, rel=1e-6)
        assert held.notes and quant["quant_method"] in held.notes[0]
    assert weight_bytes(model, on_gpu=True).format_name == ("fp8" if quant is FP8_BLOCK else
                                                           weight_bytes(model, cpu_fast_bf16=True).format_name)
