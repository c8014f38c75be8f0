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


def test_runner_output_carries_ids_for_all_and_logprobs_only_for_who_asked(tmp_path):
    """RunnerOutput: token_ids for every sampled request; logprobs (the same token, its logprob, the top-N) only
    for the requests that asked for them, so a step of plain requests builds no object per request."""
    cfg = get_hf_config("llama-3.2-1b")
    cfg.update(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
               head_dim=16, vocab_size=2048)  # the architecture, tiny
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(tmp_path / "config.json"), load_format="dummy", dtype="float32", max_model_len=64)
    runner = ModelRunner(loaded, num_blocks=8, block_size=16)
    prompts = {"plain": [5, 9, 2, 7], "asks": [3, 8, 1], "greedy": [4, 4, 6]}
    params = {"plain": SamplingParams(temperature=0), "asks": SamplingParams(temperature=0, logprobs=2),
              "greedy": SamplingParams(temperature=0)}
    news = [NewRequestData(rid, ids, [], params[rid], [i], 0) for i, (rid, ids) in enumerate(prompts.items())]
    chunks = [ScheduledChunk(rid, 0, len(ids), True) for rid, ids in prompts.items()]
    result = runner.execute_model(SchedulerOutput(chunks, new_requests=news)).result()
    assert sorted(result.token_ids) == sorted(prompts) and list(result.logprobs) == ["asks"]
    sampled = result.logprobs["asks"]
    assert sampled.token_id == result.token_ids["asks"] and len(sampled.top_logprobs) == 2
    assert sampled.top_logprobs[0][0] == sampled.token_id  # greedy: the chosen token is the most likely
    assert sampled.logprob == pytest.approx(sampled.top_logprobs[0][1])
