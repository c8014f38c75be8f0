"""fit sizes a GGUF tensor by tensor as kvpilot holds it: tiny GGUFs written here (a Q4_0 file with a tied Q8_0
embedding, a Q4_K_M-like mix with a Q6_K head, a Q2_K file kvpilot dequantizes) loaded by kvpilot's loader, whose
held bytes (packed layers, dense embedding table, norms) fit predicts within a few %."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from kvpilot.fit.gguf_holding import PACKED_EXPERT_FAMILIES, PACKED_FAMILIES, PACKED_TYPES
from kvpilot.fit.model_source import load_model as fit_load
from kvpilot.fit.weights import weight_bytes
from kvpilot.model.layers.onednn_linear import OneDnnLinear
from kvpilot.model.loader import load_model
from kvpilot.model.models.registry import FAMILIES
from kvpilot.model.quant.formats import PACKED_FORMATS
from kvpilot.model.quant.kernel import get_quant_kernel
from kvpilot.model.quant.memory_report import packed_memory
from tests.model.kquant_blocks import quantize_blocks

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 512, 2
HEAD_DIM = HIDDEN // HEADS
MATRICES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN),
            "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}


def _q4_0(name: str, layer: int) -> str:
    return "Q8_0" if name == "token_embd" else "Q4_0"


def _q4_k_m(name: str, layer: int) -> str:
    """llama.cpp's Q4_K_M pattern on 2 layers: attn_v and ffn_down Q6_K in layer 0, the head Q6_K."""
    return "Q6_K" if name == "output" or (name in ("attn_v", "ffn_down") and layer == 0) else "Q4_K"


def _iq4_xs(name: str, layer: int) -> str:
    """Bartowski-style IQ4_XS: every matrix IQ4_XS (256 and 512 values a row: whole super-blocks), the head Q8_0."""
    return "Q8_0" if name == "output" else "IQ4_XS"


def _q2_k(name: str, layer: int) -> str:
    return "Q2_K"


def _f32(name: str, layer: int) -> str:
    return "F32"


def _blocks(values: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    if type_name == "F32":
        return values
    if type_name != "Q2_K":
        return quantize_blocks(values, type_name)
    block_values, block_bytes = GGML_QUANT_SIZES[T.Q2_K]  # [scales 16][qs 64][d f16][dmin f16]
    raw = rng.integers(0, 256, size=(values.size // block_values, block_bytes), dtype=np.uint8)
    raw[:, 80:84] = np.frombuffer(np.float16([0.01, 0.001]).tobytes(), dtype=np.uint8)
    return raw.reshape(values.shape[0], -1)


def _write_gguf(path: Path, type_of, tied: bool) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, LAYERS), (writer.add_context_length, 256),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, VOCAB)):
        add(value)

    def matrix(name: str, shape: tuple[int, int], type_name: str) -> None:
        raw = _blocks((rng.standard_normal(shape) * 0.05).astype(np.float32), type_name, rng)
        writer.add_tensor(name, raw, raw_dtype=T[type_name])

    matrix("token_embd.weight", (VOCAB, HIDDEN), type_of("output" if tied else "token_embd", 0))  # tied: the head
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if not tied:
        matrix("output.weight", (VOCAB, HIDDEN), type_of("output", 0))
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
        for name, shape in MATRICES.items():
            matrix(f"blk.{i}.{name}.weight", shape, type_of(name, i))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _held_by_loader(path: Path, dtype: str, quantization: str) -> tuple[int, str]:
    """Bytes the loaded model holds for its weights (parameters, packed layers, dense bf16 layers prepacked for
    oneDNN), and how it holds them. bf16 prompt GEMMs: no float32 copies beside (a speed choice fit leaves out)."""
    loaded = load_model(str(path), dtype=dtype, quantization=quantization, max_model_len=128,
                        prompt_gemm_dtype="bfloat16")
    params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    packed = packed_memory(loaded.model, 0).packed_bytes  # what the loader logs for a GGUF, at-load blocks too
    prepacked = sum(m.onednn.nbytes for m in loaded.model.modules() if isinstance(m, OneDnnLinear))
    return params + packed + prepacked, loaded.quantization


@pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize(("mix", "tied", "packed"), [(_q4_0, True, True), (_q4_k_m, False, True),
                                                      (_iq4_xs, False, True), (_q2_k, False, False)],
                         ids=["Q4_0", "Q4_K_M", "IQ4_XS", "Q2_K"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_predicted_weight_bytes_match_what_the_loader_holds(tmp_path: Path, mix, tied: bool, packed: bool,
                                                             dtype: str) -> None:
    path = tmp_path / f"tiny-{mix.__name__.strip('_').upper()}.gguf"
    _write_gguf(path, mix, tied)
    predicted = weight_bytes(fit_load(str(path)), dtype="bf16" if dtype == "bfloat16" else "fp32")
    held, quantization = _held_by_loader(path, dtype, "gguf" if packed else "auto")  # gguf: no dense copies
    assert quantization == ("gguf" if packed else "none")
    assert predicted.num_bytes == pytest.approx(held, rel=0.03), predicted.notes
    assert predicted.format_name.endswith("held packed" if packed else "held dequantized to " +
                                          ("16-bit" if dtype == "bfloat16" else "32-bit"))
    if not packed:  # a type without a kernel: every weight at the compute dtype, the file's bits whatever they are
        assert "Q2_K (e.g. output.weight) has no packed kernel" in predicted.notes[0]
        assert predicted.num_bytes == held  # dequantized: exact
    assert predicted.num_bytes_file == sum(t.num_bytes for t in fit_load(str(path)).gguf.tensors)


@pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_at_load_is_sized_as_the_blocks_kvpilot_makes(tmp_path: Path, quantization: str) -> None:
    """--quantization int4 / int8 on a CPU: Q4_1 / Q8_0 blocks, the output layer Q8_0 (float32 file, bf16 run)."""
    path = tmp_path / "tiny-F32.gguf"
    _write_gguf(path, _f32, tied=False)
    predicted = weight_bytes(fit_load(str(path)), quantization, dtype="bf16")
    held, how = _held_by_loader(path, "bfloat16", quantization)
    assert how == quantization and predicted.num_bytes_file is None
    assert predicted.num_bytes == pytest.approx(held, rel=0.03), predicted.notes


def test_fit_knows_what_kvpilot_runs_packed() -> None:
    """fit is torch-free, so it keeps its own copy of the loader's facts: they must agree."""
    assert set(PACKED_TYPES) == set(PACKED_FORMATS)
    assert PACKED_FAMILIES == {f.name for f in FAMILIES if f.packed_gguf and "gguf" in f.formats}
    assert PACKED_EXPERT_FAMILIES == {f.name for f in FAMILIES if f.packed_gguf_experts and "gguf" in f.formats}


@pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_predicted_weight_bytes_match_a_packed_moe_gguf(tmp_path: Path, dtype: str) -> None:
    """A tiny Qwen3-MoE GGUF (8 experts, top-2) in a Q4_K_M-like mix: the loader keeps its experts packed (bf16 on a
    VNNI CPU: their int8 copies), and fit predicts the whole of what it holds, experts and router included."""
    pytest.importorskip("transformers")
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvpilot.fit.model_catalog import get_hf_config
    from kvpilot.model.quant.packed_experts import PackedExperts
    from tests.model.moe_gguf import write_moe_gguf

    cfg = {**get_hf_config("qwen3-30b-a3b"), "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": VOCAB, "num_experts": 8,
           "moe_intermediate_size": 256, "num_experts_per_tok": 2, "mlp_only_layers": [], "bos_token_id": 1,
           "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), dtype=torch.float32)
    path = tmp_path / "tiny-moe-Q4_K_M.gguf"
    write_moe_gguf(hf, path, "qwen3moe", types=lambda name: "Q6_K" if "down" in name or "attn_v" in name
                   or name == "output.weight" else "Q4_K")
    predicted = weight_bytes(fit_load(str(path)), dtype="bf16" if dtype == "bfloat16" else "fp32")
    held, quantization = _held_by_loader(path, dtype, "gguf")
    assert quantization == "gguf" and predicted.format_name.endswith("held packed")
    assert predicted.num_bytes == pytest.approx(held, rel=0.03), predicted.notes
    loaded = load_model(str(path), dtype=dtype, quantization="gguf", max_model_len=128)
    experts = sum(m.nbytes for m in loaded.model.modules() if isinstance(m, PackedExperts))
    assert experts == loaded.packed_memory.expert_bytes > 0
    # the decode roofline's routed expert: what the loader holds for one, on average
    assert predicted.num_bytes_expert == pytest.approx(experts / (2 * 8), rel=0.01)


@pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")
def test_predicted_weight_bytes_match_a_gpt_oss_gguf_with_packed_experts(tmp_path: Path) -> None:
    """gpt-oss's experts stay packed (MXFP4 blocks, float32 kernel: no int8 copy), its other weights dequantized:
    fit predicts both parts of what the loader holds, and the routed expert's bytes the roofline reads."""
    pytest.importorskip("transformers")
    from kvpilot.model.quant.packed_experts import PackedExperts
    from tests.model.gpt_oss_gguf import write_gpt_oss_gguf
    from tests.model.test_gpt_oss import CONFIG, _random_hf_model

    path = tmp_path / "tiny-gpt-oss-MXFP4.gguf"
    write_gpt_oss_gguf(_random_hf_model({**CONFIG, "swiglu_limit": 7.0}, tmp_path / "hf"), path, "MXFP4")
    predicted = weight_bytes(fit_load(str(path)), dtype="bf16")
    held, quantization = _held_by_loader(path, "bfloat16", "auto")
    assert quantization == "gguf" and predicted.format_name.endswith("held experts packed, the rest dequantized "
                                                                     "to 16-bit"), predicted.format_name
    assert predicted.num_bytes == pytest.approx(held, rel=0.03), predicted.notes
    loaded = load_model(str(path), dtype="bfloat16", max_model_len=128)
    experts = sum(m.nbytes for m in loaded.model.modules() if isinstance(m, PackedExperts))
    assert predicted.num_bytes_expert == pytest.approx(experts / (3 * 8), rel=0.01)
