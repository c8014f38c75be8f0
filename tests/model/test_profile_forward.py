"""The KV-budget profile (CUDA's gpu_memory_utilization path) runs one full token budget through a throwaway
runner. It once asked for a block past its own limit, and once for positions past the model's rotary table
(a budget larger than max_model_len): every CUDA engine failed to start. Budgets at and off block boundaries,
below and above the model's length."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine_build import profile_forward
from kvpilot.model.loader import load_model


@pytest.mark.parametrize("num_tokens", [64, 65, 100, 300])
def test_profile_forward_takes_a_whole_budget(num_tokens):
    loaded = load_model("smollm2-135m", load_format="dummy", dtype="float32", device="cpu", max_model_len=128)
    assert loaded.model.rotary.max_positions == 128  # positions past it fail (IndexError here, an assert on CUDA)
    assert profile_forward(loaded, num_tokens, 16, torch.float32, lambda: 7) == 7
