"""CPU weight re-layout: every linear weight and a tied output embedding become [out, in] views of contiguous
[in, out] storage, with values, shapes and results unchanged."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.model.loader import load_model


def test_linear_weights_and_the_tied_output_embedding_are_re_laid_with_the_same_values(tmp_path):
    cfg = get_hf_config("smollm2-135m")
    cfg["num_hidden_layers"] = 2
    assert cfg["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(tmp_path / "config.json"), load_format="dummy", dtype="float32", max_model_len=64,
                        device="cpu")
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    table = model.output_weight()
    assert table is model.embed_tokens.weight  # still one tensor for both uses, no copy
    assert table.shape == (cfg["vocab_size"], cfg["hidden_size"]) and table.t().is_contiguous()

    reference = table.contiguous()
    ids = torch.tensor([0, 5, cfg["vocab_size"] - 1])
    assert torch.equal(model.embed_tokens(ids), reference[ids])
    hidden = torch.randn(3, cfg["hidden_size"])
    torch.testing.assert_close(model.logits(hidden), F.linear(hidden, reference), rtol=1e-5, atol=1e-5)
