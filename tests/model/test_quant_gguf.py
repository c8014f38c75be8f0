"""GGUF linear weights kept packed (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) compute what the dequantized
model computes; an unsupported tensor type asked to stay packed is a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from kvpilot.model.errors import ModelLoadError
from kvpilot.model.loader import load_model
from kvpilot.model.quant.kernel import get_quant_kernel
from kvpilot.model.quant.linear import PackedLinear
from tests.model.test_gguf_types import HIDDEN, _write_gguf

needs_kernel = pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")


@needs_kernel
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K],
                         ids=lambda t: t.name)
def test_packed_layers_match_dequantized(qtype, tmp_path):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    _write_gguf(path, qtype)
    packed = load_model(str(path), dtype="float32", max_model_len=64)
    dense = load_model(str(path), dtype="float32", max_model_len=64, quantization="none")
    assert packed.quantization == "gguf" and dense.quantization == "none"
    assert isinstance(packed.model.lm_head, PackedLinear) and packed.model.output_weight() is None
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows in (1, 5, 40):  # kernel rows and dequantize + GEMM rows
            x = torch.randn(rows, HIDDEN, generator=generator)
            _close(packed.model.logits(x), dense.model.logits(x))
            for lp, ld in zip(packed.model.layers, dense.model.layers):
                # Q/K rows un-permuted and q/k/v fused exactly as in the dense model
                _close(lp.self_attn.qkv_proj(x), ld.self_attn.qkv_proj(x))
                _close(lp.mlp(x), ld.mlp(x))


def _close(packed: torch.Tensor, dense: torch.Tensor) -> None:
    """float32 sums in another order: within 1e-5 relative, or 1e-5 of the largest value (the K-quants' random
    sub-scales make values of ~10 whose sums cancel)."""
    torch.testing.assert_close(packed, dense, rtol=1e-5, atol=1e-5 * max(1.0, float(dense.abs().max())))


def test_explicit_packing_names_unsupported_type(tmp_path):
    path = tmp_path / "tiny-F16.gguf"
    _write_gguf(path, T.F16)
    with pytest.raises(ModelLoadError, match=r"type F16 .*support Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"
                                             r".*--quantization none"):
        load_model(str(path), dtype="float32", max_model_len=64, quantization="gguf")
    # auto dequantizes what the kernels lack, as before
    assert load_model(str(path), dtype="float32", max_model_len=64).quantization == "none"


def test_quantization_setting_is_checked():
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model("dummy:smollm2-135m", dtype="float32", max_model_len=64, quantization="gguf")
    with pytest.raises(ModelLoadError, match="not one of auto, gguf, none"):
        load_model(None, quantization="int3")


@needs_kernel
def test_auto_with_bfloat16_is_hybrid_packed_plus_resident_dense(tmp_path):
    """bf16 activations under auto (bf16 prompt GEMMs): the kernel for few rows, and for many rows a dense bf16 copy built once
    and kept (the same values as the dequantized model's weights, in oneDNN's blocked layout where bf16 GEMMs
    take it, else in the dense model's memory layout: bf16 as is, others [in, out]); with VNNI, a
    Q4 layer's tiled int8 copy takes every row count of decode steps, the dense copy those of prompt steps; gguf
    (packed only) takes the same tiled path and fills the shared scratch matrix from it for prompt steps."""
    path = tmp_path / "tiny-Q4_1.gguf"
    _write_gguf(path, T.Q4_1)
    hybrid = load_model(str(path), dtype="bfloat16", max_model_len=64, prompt_gemm_dtype="bfloat16")
    dense = load_model(str(path), dtype="bfloat16", max_model_len=64, quantization="none", prompt_gemm_dtype="bfloat16")
    forced = load_model(str(path), dtype="bfloat16", max_model_len=64, quantization="gguf",
                        prompt_gemm_dtype="bfloat16")
    layer, dense_layer = hybrid.model.layers[0].mlp.gate_up_proj, dense.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, PackedLinear) and layer.keep_dense
    assert not forced.model.layers[0].mlp.gate_up_proj.keep_dense  # gguf: packed only
    packed_bytes = layer.nbytes
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed_only = forced.model.layers[0].mlp.gate_up_proj
    if layer.int8_gate is not None:
        layer.int8_gate.open = False  # as in a step with prompt tokens: the dense copy, not the tiled int8 path
    with torch.no_grad():
        many = layer(x)
        if layer._onednn is not None:  # kept in oneDNN's blocked layout (layers/onednn_linear.py): the same values
            resident = layer._onednn.dense()
            assert torch.equal(many, F.linear(x, dense_layer.weight))  # and the same products, bit for bit
        else:
            resident = layer._dense(torch.bfloat16)
            assert resident is layer._dense(torch.bfloat16)  # built once, then kept
            assert resident.stride() == dense_layer.weight.stride()
        assert torch.equal(resident, dense_layer.weight)
        if layer.int8_weight is None:  # no VNNI: the dense copy is built on the first many-row call
            assert layer.nbytes == packed_bytes + resident.numel() * 2
        else:  # the int8 path: dense copy built at load, the packed quants dropped (its int8 copy has them)
            assert layer.quants_released and layer.nbytes == packed_bytes
            # packed only (gguf) holds the same int8 copy, quants dropped too, and no dense copy: prompt steps
            # dequantize the tiled copy into the shared scratch matrix, the same values
            assert packed_only.quants_released and packed_only.int8_gate is not None
            assert layer.nbytes == packed_only.nbytes + resident.numel() * 2
            assert torch.equal(layer.weight, packed_only.weight)  # same values
            packed_only.int8_gate.open = False
            assert torch.equal(packed_only._dense(torch.bfloat16), resident)
            torch.testing.assert_close(packed_only(x), many)  # the same values; the GEMM may sum in another order
            torch.testing.assert_close(layer(x.float()), dense_layer(x).float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(many, dense_layer(x))
        few = layer(x[:1])  # the kernel (float32 accumulation of the same values)
        torch.testing.assert_close(few.float(), dense_layer(x[:1]).float(), rtol=2e-2, atol=2e-2)


def test_hybrid_only_when_the_dense_copy_fits_a_quarter_of_the_memory():
    import numpy as np

    from kvpilot.model.quant.formats import packed_format
    from kvpilot.model.quant.model_pack import keeps_dense
    from kvpilot.model.quant.packed import PackedWeight

    fmt = packed_format("Q8_0")
    packed = {"w": PackedWeight.from_blocks(np.zeros((64, 2 * fmt.block_bytes), dtype=np.uint8), fmt)}
    dense_bytes = 64 * 64 * 2  # [64 out, 64 in] in bf16
    assert keeps_dense("auto", torch.bfloat16, packed, available_bytes=4 * dense_bytes)
    assert not keeps_dense("auto", torch.bfloat16, packed, available_bytes=4 * dense_bytes - 1)
    assert not keeps_dense("auto", torch.float32, packed, available_bytes=1 << 40)  # float32: packed only
    assert not keeps_dense("gguf", torch.bfloat16, packed, available_bytes=1 << 40)
