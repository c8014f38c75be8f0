"""The model runner on the Triton backend gives the reference backend's logits, through the selector, on a
small dummy-weight Qwen3 (q/k norm, GQA group 4, head dim 64): a chunked prompt in scattered blocks batched
with another sequence's decodes."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.engine.scheduler_output import NewRequestData, RunningRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.model.loader import load_model
from kvpilot.model.runner import ModelRunner
from kvpilot.sampling_params import SamplingParams
from tests.model.triton_cases import ON_GPU, TRITON_SKIP_REASON

pytestmark = pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")
PROMPT = [(17 * i + 3) % 500 for i in range(30)]  # decodes below stay inside the prompt


def _new(*requests: tuple[str, list[int], int]) -> SchedulerOutput:
    """New requests (id, blocks, tokens computed), each prefilling from position 0 without sampling."""
    news = [NewRequestData(rid, PROMPT, [], SamplingParams(), blocks, 0) for rid, blocks, _ in requests]
    return SchedulerOutput([ScheduledChunk(rid, 0, n, False) for rid, _, n in requests], new_requests=news)


def _running(*chunks: ScheduledChunk) -> SchedulerOutput:
    return SchedulerOutput(list(chunks), running_requests=[RunningRequestData(c.request_id, [], c.start_position)
                                                           for c in chunks])


SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "torch_dtype": "float32"}


def _logits(loaded, backend: str) -> torch.Tensor:
    runner = ModelRunner(loaded, num_blocks=16, block_size=4, attention_backend=backend)
    assert runner.attention.name == backend
    runner.forward_logits(_new(("a", [9, 2, 14, 5, 11, 0, 13], 9), ("b", [3, 15, 7, 1, 12, 6, 8, 4], 20)))
    steps = []
    for chunks in ([ScheduledChunk("a", 9, 12, True), ScheduledChunk("b", 20, 1, True)],  # prefix 9 + chunk 12
                   [ScheduledChunk("a", 21, 1, True), ScheduledChunk("b", 21, 1, True)]):  # two decodes
        _, logits = runner.forward_logits(_running(*chunks))
        steps.append(logits.cpu())
    return torch.cat(steps)


def test_runner_logits_match_torch_backend(tmp_path):
    config = {**get_hf_config("qwen3-0.6b"), **SMALL}
    config.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path), load_format="dummy", dtype="float32", max_model_len=64,
                        device="cuda" if ON_GPU else "cpu")  # the runners only read the weights: share them
    torch.testing.assert_close(_logits(loaded, "triton"), _logits(loaded, "torch"), rtol=1e-4, atol=1e-4)


def test_qwen3_takes_the_fused_small_kernels(tmp_path, monkeypatch):
    """Routed through the Triton small ops (as CUDA tensors are), Qwen3's q/k norms and rotary run as one
    kernel per layer, each residual add runs inside the norm after it, and the logits stay the reference's."""
    import kvpilot.model.models.llama as llama
    from kvpilot.model.layers import triton_small_ops

    config = {**get_hf_config("qwen3-0.6b"), **SMALL}
    config.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path), load_format="dummy", dtype="float32", max_model_len=64,
                        device="cuda" if ON_GPU else "cpu")
    reference = _logits(loaded, "torch")
    calls: list[str] = []
    for name in ("qk_norm_rotary", "add_rms_norm"):
        fn = getattr(triton_small_ops, name)
        monkeypatch.setattr(triton_small_ops, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    monkeypatch.setattr(llama, "small_ops_for", lambda x: triton_small_ops)
    logits = _logits(loaded, "triton")
    layers, forwards = SMALL["num_hidden_layers"], 3
    assert calls.count("qk_norm_rotary") == forwards * layers  # every layer of the three forwards
    assert calls.count("add_rms_norm") == forwards * 2 * layers  # every residual add (the final norm's too)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
