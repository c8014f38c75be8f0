"""The GGUF loader reads every tensor type the `gguf` package dequantizes (float, legacy and K-quants),
in the right orientation, with llama Q/K permutation undone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from kvpilot.model.loader import load_model

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 512, 2
HEAD_DIM = HIDDEN // HEADS
TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANT_SCALE_OFFSETS = {T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}  # f16 scale fields in each block


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (what a real llama GGUF stores)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(values: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes/values of `values` in `qtype`; K-quants (no Python quantizer) get random valid blocks."""
    if qtype not in K_QUANT_SCALE_OFFSETS:
        return quantize(values, qtype)
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    num_blocks = values.size // block_values
    raw = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS[qtype]:  # keep scales finite and small
        raw[:, offset:offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return raw.reshape(values.shape[0], -1)


def _write_gguf(path, qtype: T) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF whose matrices are stored as `qtype`; returns the expected (dequantized, HF-layout) weights."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    expected: dict[str, np.ndarray] = {}

    def add(name: str, hf_name: str, shape: tuple[int, ...], permute_heads: int = 0, matrix: bool = True) -> None:
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        stored = _permute(values, permute_heads) if permute_heads else values
        if not matrix:
            writer.add_tensor(name, stored + 1.0)
            expected[hf_name] = values + 1.0
            return
        raw = _encode(stored, qtype, rng)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        dequantized = dequantize(raw, qtype).reshape(shape)
        expected[hf_name] = dequantized
        if permute_heads:  # the loader must undo the permutation of what was stored
            inverse = dequantized.reshape(permute_heads, dequantized.shape[0] // permute_heads // 2, 2, -1)
            expected[hf_name] = inverse.swapaxes(1, 2).reshape(shape)

    add("token_embd.weight", "embed_tokens", (VOCAB, HIDDEN))
    add("output_norm.weight", "norm", (HIDDEN,), matrix=False)
    add("output.weight", "lm_head", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", f"{i}.input_layernorm", (HIDDEN,), matrix=False)
        add(f"blk.{i}.ffn_norm.weight", f"{i}.post_attention_layernorm", (HIDDEN,), matrix=False)
        add(f"blk.{i}.attn_q.weight", f"{i}.q", (HIDDEN, HIDDEN), permute_heads=HEADS)
        add(f"blk.{i}.attn_k.weight", f"{i}.k", (KV_HEADS * HEAD_DIM, HIDDEN), permute_heads=KV_HEADS)
        add(f"blk.{i}.attn_v.weight", f"{i}.v", (KV_HEADS * HEAD_DIM, HIDDEN))
        add(f"blk.{i}.attn_output.weight", f"{i}.o", (HIDDEN, HIDDEN))
        add(f"blk.{i}.ffn_gate.weight", f"{i}.gate", (FFN, HIDDEN))
        add(f"blk.{i}.ffn_up.weight", f"{i}.up", (FFN, HIDDEN))
        add(f"blk.{i}.ffn_down.weight", f"{i}.down", (HIDDEN, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_tensor_type_loads_exactly(qtype, tmp_path):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    exp = _write_gguf(path, qtype)
    loaded = load_model(str(path), dtype="float32", max_model_len=256)
    model = loaded.model
    assert loaded.tokenizer is None and not loaded.config.tie_word_embeddings

    def same(param: torch.Tensor, *names: str) -> None:
        want = np.concatenate([exp[n] for n in names]) if len(names) > 1 else exp[names[0]]
        np.testing.assert_array_equal(param.detach().numpy(), want.astype(np.float32))

    same(model.embed_tokens.weight, "embed_tokens")
    same(model.lm_head.weight, "lm_head")
    same(model.norm.weight, "norm")
    for i, layer in enumerate(model.layers):
        same(layer.self_attn.qkv_proj.weight, f"{i}.q", f"{i}.k", f"{i}.v")
        same(layer.self_attn.o_proj.weight, f"{i}.o")
        same(layer.mlp.gate_up_proj.weight, f"{i}.gate", f"{i}.up")
        same(layer.mlp.down_proj.weight, f"{i}.down")
        same(layer.input_layernorm.weight, f"{i}.input_layernorm")
    from kvpilot import LLM, SamplingParams

    out = LLM(loaded=loaded, kv_cache_memory="8MiB", max_model_len=256).generate(
        [[1, 5, 9, 200]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and all(0 <= t < VOCAB for t in out.outputs[0].token_ids)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.F16], ids=lambda t: t.name)
def test_a_dequantized_gguf_warns_with_its_memory_cost(qtype, tmp_path, caplog):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    _write_gguf(path, qtype)
    with caplog.at_level("WARNING", logger="kvpilot"):
        load_model(str(path), dtype="float32", max_model_len=256, quantization="none")
    warned = [r.getMessage() for r in caplog.records if "dequantized at load" in r.getMessage()]
    if qtype == T.F16:  # dense values already: nothing to warn about
        assert warned == []
    else:
        assert len(warned) == 1 and "Q8_0 tensors" in warned[0]
        ratio = float(warned[0].split("(")[-1].split("x the memory")[0])
        assert 3.0 < ratio < 4.5, warned[0]  # float32 (4 bytes) against ~1.06 bytes a weight (norms stay F32)
