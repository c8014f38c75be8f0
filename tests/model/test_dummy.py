"""Dummy (random) weights for large architectures, from the catalog or a config file."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.model.loader import load_model
from kvpilot.model.runner import ModelRunner
from kvpilot.engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.sampling_params import SamplingParams


def _forward(loaded, prompt_len: int = 20) -> torch.Tensor:
    runner = ModelRunner(loaded, num_blocks=8, block_size=16)
    new = NewRequestData("r", [(7 * i) % 1000 for i in range(prompt_len)], [], SamplingParams(), [3, 5], 0)
    ids, logits = runner.forward_logits(SchedulerOutput([ScheduledChunk("r", 0, prompt_len, True)],
                                                        new_requests=[new]))
    assert ids == ["r"]
    return logits


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b"])
def test_dummy_architecture_forward(name, tmp_path):
    cfg = get_hf_config(name)
    cfg["num_hidden_layers"] = 2  # the real layer shapes, fewer layers for speed
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(tmp_path / "config.json"), load_format="dummy", dtype="bfloat16", max_model_len=256)
    assert loaded.config.hidden_size == cfg["hidden_size"]
    assert loaded.config.qk_norm == (name == "qwen3-0.6b")
    assert (loaded.config.rope_scaling is not None) == (name == "llama-3.2-1b")
    logits = _forward(loaded)
    assert logits.shape == (1, cfg["vocab_size"])
    assert torch.isfinite(logits).all()


def test_dummy_by_catalog_name_is_reproducible():
    first = load_model("dummy:smollm2-135m", dtype="float32", max_model_len=256, seed=3)
    assert first.load_format == "dummy" and first.config.num_hidden_layers == 30
    assert first.tokenizer is not None  # borrows the embedded tokenizer (same vocabulary size)
    second = load_model("smollm2-135m", load_format="dummy", dtype="float32", max_model_len=256, seed=3)
    torch.testing.assert_close(_forward(first), _forward(second), rtol=0, atol=0)
