"""The KV-budget profile (CUDA's gpu_memory_utilization path) runs one full token budget through a throwaway
runner. It once asked for a block past its own limit, and once for positions past the model's rotary table
(a budget larger than max_model_len): every CUDA engine failed to start. Budgets at and off block boundaries,
below and above the model's length."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot.model.kv_budget import profile_forward
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.model.loader import load_model

SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "config.json"
    path.write_text(json.dumps({**get_hf_config("smollm2-135m"), **SMALL}))
    return load_model(str(path), load_format="dummy", dtype="float32", device="cpu", max_model_len=128)


@pytest.mark.parametrize("num_tokens", [64, 65, 100, 300])
def test_profile_forward_takes_a_whole_budget(loaded, num_tokens):
    assert loaded.model.rotary.max_positions == 128  # positions past it fail (IndexError here, an assert on CUDA)
    assert profile_forward(loaded, num_tokens, 16, torch.float32, lambda: 7) == 7
