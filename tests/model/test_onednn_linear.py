"""bf16 weights in oneDNN's blocked layout give F.linear's products bit for bit, at every row count, on CPUs
without AMX; with AMX oneDNN picks its blocking by the call's shape and the weight's layout (F.linear on the two
layouts differs too), so there they agree within a bf16 rounding."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kvpilot.fit.fingerprint import cpu_has_amx_bf16
from kvpilot.model.layers.onednn_linear import OneDnnWeight, onednn_bf16_applies

CPU = torch.device("cpu")
AMX = cpu_has_amx_bf16()
pytestmark = pytest.mark.skipif(not onednn_bf16_applies(torch.bfloat16, CPU),
                                reason="this CPU or torch build has no oneDNN bf16 GEMM")


@pytest.mark.parametrize("in_features, out_features", [(576, 960), (1536, 576), (576, 3072), (64, 48)])
def test_products_equal_f_linear_bit_for_bit(in_features: int, out_features: int) -> None:
    gen = torch.Generator().manual_seed(in_features + out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    prepacked = OneDnnWeight(weight)
    for rows in (1, 3, 16, 17, 64, 144, 512):
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        out = prepacked.linear(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        for layout in (weight, weight.t().contiguous().t()):  # the [in, out] layout too
            if AMX:
                torch.testing.assert_close(out.float(), F.linear(x, layout).float(), rtol=1 / 128, atol=1e-2)
            else:
                assert torch.equal(out, F.linear(x, layout)), rows


def test_the_plain_values_come_back_and_a_strided_input_is_taken() -> None:
    weight = torch.randn(96, 64).to(torch.bfloat16)
    prepacked = OneDnnWeight(weight)
    assert torch.equal(prepacked.dense(), weight) and prepacked.nbytes == 96 * 64 * 2
    wide = torch.randn(8, 128).to(torch.bfloat16)
    assert torch.equal(prepacked.linear(wide[:, ::2]), F.linear(wide[:, ::2], weight))


def test_only_bf16_on_cpu_applies() -> None:
    assert not onednn_bf16_applies(torch.float32, CPU)
    assert not onednn_bf16_applies(torch.bfloat16, torch.device("meta"))


@pytest.mark.parametrize("tied", [False, True])
def test_a_dense_bf16_models_projections_are_prepacked_and_compute_the_same(tmp_path, tied: bool) -> None:
    """A dummy Qwen2-shaped model (qkv bias) in bf16: every decoder projection becomes a Bf16Linear where this CPU
    has AVX512_BF16 (few rows: kvpilot's kernel, many: F.linear bit for bit), else a OneDnnLinear whose forward is
    F.linear's bit for bit, bias included; an untied output layer too (the model's output head, float32 logits).
    A tied one stays the embedding table, row-major, and with the kernel becomes the output head as it is."""
    from torch import nn

    from kvpilot.model.layers.bf16_linear import KERNEL_MAX_ROWS, Bf16Linear, bf16_gemm_kernel
    from kvpilot.model.layers.onednn_linear import OneDnnLinear, prepack_bf16_linears
    from kvpilot.model.loader import load_model
    from tests.model.test_tp_loading import _hf_config

    kind = Bf16Linear if bf16_gemm_kernel(torch.bfloat16, CPU) is not None else OneDnnLinear
    config = tmp_path / "qwen2.json"
    config.write_text(json.dumps({**_hf_config("qwen2.5-72b", 4, 2), "tie_word_embeddings": tied}))
    loaded = load_model(str(config), load_format="dummy", dtype="bfloat16", max_model_len=64)
    model = loaded.model
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, kind) and attn.qkv_proj.bias is not None
    assert sum(isinstance(m, kind) for m in model.layers.modules()) == 4 * len(model.layers)
    assert not any(isinstance(m, nn.Linear) for m in model.layers.modules())
    assert prepack_bf16_linears(model) == 0  # nothing left to prepack
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, attn.qkv_proj.in_features, generator=gen).to(torch.bfloat16)
    expected = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias)
    got = attn.qkv_proj(x)
    assert expected.shape[:2] == (5, 2) and got.shape == expected.shape
    if kind is OneDnnLinear:
        assert torch.equal(got, expected)
    else:  # the kernel's sums in another order: within a bf16 rounding of F.linear's
        assert torch.allclose(got.float(), expected.float(), rtol=1 / 128, atol=1e-2)
        many = torch.randn(KERNEL_MAX_ROWS + 1, attn.qkv_proj.in_features, generator=gen).to(torch.bfloat16)
        assert torch.equal(attn.qkv_proj(many), F.linear(many, attn.qkv_proj.weight, attn.qkv_proj.bias))
    hidden = torch.randn(3, attn.qkv_proj.in_features, generator=gen).to(torch.bfloat16)
    reference = F.linear(hidden.double(), model.embed_tokens.weight.double() if tied else
                         model.lm_head.weight.double()).float()
    if tied:
        table = model.embed_tokens.weight
        assert table.is_contiguous()  # row-major: faster for oneDNN and the kernel, and lookups
        if kind is OneDnnLinear:
            assert model.output_head is None
            assert torch.equal(model.logits(hidden), F.linear(hidden, table).float())
        else:
            assert isinstance(model.output_head, Bf16Linear) and model.output_head.weight is table
    else:
        assert isinstance(model.lm_head, kind) and model.output_head is model.lm_head
    logits = model.logits(hidden)
    assert logits.dtype == torch.float32
    if kind is OneDnnLinear and not tied:
        assert torch.equal(logits, F.linear(hidden, model.lm_head.weight).float())
    elif kind is Bf16Linear:  # float32 sums, not rounded to bf16
        assert torch.allclose(logits, reference, rtol=1e-5, atol=1e-5)


def test_float32_prompt_copies_keep_onednn(tmp_path) -> None:
    """Asking for float32 copies (prompt GEMMs in float32) keeps OneDnnLinear, which holds them, on every CPU."""
    from kvpilot.model.layers.onednn_linear import OneDnnLinear, prepack_bf16_linears
    from kvpilot.model.loader import load_model
    from tests.model.test_tp_loading import _hf_config

    config = tmp_path / "qwen2.json"
    config.write_text(json.dumps(_hf_config("qwen2.5-72b", 4, 2)))
    loaded = load_model(str(config), load_format="dummy", dtype="float32", max_model_len=64)
    model = loaded.model.to(torch.bfloat16)
    assert prepack_bf16_linears(model, float32_min_rows=32) == 4 * len(model.layers) + 1
    assert isinstance(model.layers[0].mlp.down_proj, OneDnnLinear) and isinstance(model.output_head, OneDnnLinear)


def test_amx_cpus_keep_prepacked_copies_for_many_rows(tmp_path, monkeypatch) -> None:
    """On an AMX CPU (its flag patched in here, so any CPU with the AVX512_BF16 kernel checks the mechanism) a dense
    bf16 model's decoder projections keep a oneDNN-prepacked copy: calls of ONEDNN_MIN_ROWS rows or more run it,
    fewer the kernel, and the fused decode step takes the copies from that many rows on. The output head (the
    tied table) keeps float32 logits, from a float32 copy of the table in oneDNN's bf16 math mode from
    FLOAT32_COPY_MIN_ROWS rows (the float32 sums of exact products, the mode restored after the call), where the
    kernel module cannot use AMX tiles (patched so here; tests/model/test_amx_tiles.py has the tiles). Copies
    that would not fit the memory share are not made."""
    from torch import nn

    from kvpilot.fit.model_catalog import get_hf_config
    from kvpilot.model.fused_decode import DENSE_FUSED_MAX_ROWS
    from kvpilot.model.layers import onednn_linear
    from kvpilot.model.layers.bf16_linear import FLOAT32_COPY_MIN_ROWS, ONEDNN_MIN_ROWS, Bf16Linear, \
        bf16_gemm_kernel, bf16_math_linear
    from kvpilot.model.loader import load_model

    if bf16_gemm_kernel(torch.bfloat16, CPU) is None:
        pytest.skip("no AVX512_BF16 kernel on this CPU: dense bf16 layers are OneDnnLinear")
    monkeypatch.setattr(onednn_linear, "cpu_has_amx_bf16", lambda: True)
    monkeypatch.setattr(onednn_linear, "amx_tiles_kernel", lambda kernel, weight: None)
    small = nn.Module()
    small.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 64, bias=False).to(torch.bfloat16))])
    assert onednn_linear.amx_onednn_copies(small, 10**9) and not onednn_linear.amx_onednn_copies(small, 4 * 64 * 64)
    config = get_hf_config("smollm2-135m")
    config["num_hidden_layers"] = 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    model = load_model(str(path), load_format="dummy", dtype="bfloat16", max_model_len=64).model
    projections = [m for m in model.layers.modules() if isinstance(m, Bf16Linear)]
    assert len(projections) == 4 * 2 and all(isinstance(m.onednn, OneDnnWeight) for m in projections)
    head = model.output_head
    assert isinstance(head, Bf16Linear) and head.onednn is None and head.weight is model.embed_tokens.weight
    assert head.float32_copy.dtype == torch.float32 and torch.equal(head.float32_copy, head.weight.float())
    fused = model.fused_decode
    assert fused is not None and fused.wide_min_rows == ONEDNN_MIN_ROWS and fused.max_rows == DENSE_FUSED_MAX_ROWS
    down = model.layers[0].mlp.down_proj
    gen = torch.Generator().manual_seed(1)
    for rows in (ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, 3 * ONEDNN_MIN_ROWS):
        x = torch.randn(rows, down.in_features, generator=gen).to(torch.bfloat16)
        by_kernel = torch.empty(rows, down.out_features, dtype=torch.bfloat16)
        down.kernel.bf16_linear(by_kernel, x, down.weight.detach(), None)
        assert torch.equal(down(x), by_kernel if rows < ONEDNN_MIN_ROWS else down.onednn.linear(x)), rows
    precision = torch.backends.mkldnn.matmul.fp32_precision
    for rows in (FLOAT32_COPY_MIN_ROWS - 1, FLOAT32_COPY_MIN_ROWS, 64):
        x = torch.randn(rows, head.in_features, generator=gen).to(torch.bfloat16)
        by_kernel = torch.empty(rows, head.out_features, dtype=torch.float32)
        head.kernel.bf16_linear(by_kernel, x, head.weight.detach(), None)
        logits = head.forward_float32(x)
        exact = F.linear(x.double(), head.weight.double())
        assert logits.dtype == torch.float32 and torch.allclose(logits.double(), exact, rtol=0, atol=1e-5), rows
        by_copy = bf16_math_linear(x.float(), head.float32_copy, None)
        assert torch.equal(logits, by_kernel if rows < FLOAT32_COPY_MIN_ROWS else by_copy), rows
        assert torch.backends.mkldnn.matmul.fp32_precision == precision


def test_the_onednn_layout_is_tuned_for_64_rows_on_amx_cpus_only(monkeypatch) -> None:
    """The batch-size hint of the prepacked layout (AMX: 64, measured faster from 8 to 2,048 rows; else 1). The
    products of either layout are checked above, with this CPU's hint."""
    from kvpilot.model.layers import onednn_linear

    for amx, hint in ((True, 64), (False, 1)):
        onednn_linear.onednn_batch_hint.cache_clear()
        monkeypatch.setattr(onednn_linear, "cpu_has_amx_bf16", lambda amx=amx: amx)
        assert onednn_linear.onednn_batch_hint() == hint
    onednn_linear.onednn_batch_hint.cache_clear()
