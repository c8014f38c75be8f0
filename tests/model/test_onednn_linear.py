"""bf16 weights in oneDNN's blocked layout give F.linear's products bit for bit, at every row count."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kvpilot.model.layers.onednn_linear import OneDnnWeight, onednn_bf16_applies

CPU = torch.device("cpu")
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
        assert torch.equal(out, F.linear(x, weight)), rows
        assert torch.equal(out, F.linear(x, weight.t().contiguous().t())), rows  # the [in, out] layout too


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
    """A dummy Qwen2-shaped model (qkv bias) in bf16: every decoder projection becomes a OneDnnLinear whose
    forward is F.linear's bit for bit, bias included; an untied output layer too (the model's output head,
    float32 logits), while a tied one stays the embedding table, row-major."""
    from torch import nn

    from kvpilot.model.layers.onednn_linear import OneDnnLinear, prepack_bf16_linears
    from kvpilot.model.loader import load_model
    from tests.model.test_tp_loading import _hf_config

    config = tmp_path / "qwen2.json"
    config.write_text(json.dumps({**_hf_config("qwen2.5-72b", 4, 2), "tie_word_embeddings": tied}))
    loaded = load_model(str(config), load_format="dummy", dtype="bfloat16", max_model_len=64)
    model = loaded.model
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, OneDnnLinear) and attn.qkv_proj.bias is not None
    assert sum(isinstance(m, OneDnnLinear) for m in model.layers.modules()) == 4 * len(model.layers)
    assert not any(isinstance(m, nn.Linear) for m in model.layers.modules())
    assert prepack_bf16_linears(model) == 0  # nothing left to prepack
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, attn.qkv_proj.in_features, generator=gen).to(torch.bfloat16)
    expected = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias)
    assert torch.equal(attn.qkv_proj(x), expected) and expected.shape[:2] == (5, 2)
    hidden = torch.randn(3, attn.qkv_proj.in_features, generator=gen).to(torch.bfloat16)
    if tied:
        table = model.embed_tokens.weight
        assert model.output_head is None and table.is_contiguous()  # row-major: faster for oneDNN, and lookups
        assert torch.equal(model.logits(hidden), F.linear(hidden, table).float())
    else:
        assert isinstance(model.lm_head, OneDnnLinear) and model.output_head is model.lm_head
        logits = model.logits(hidden)
        assert logits.dtype == torch.float32 and torch.equal(logits, F.linear(hidden, model.lm_head.weight).float())
