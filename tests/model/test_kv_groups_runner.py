"""The model runner with KV groups (engine/kv_groups.py) on a tiny dummy-weight Gemma 2 (layers 0 and 2 slide
over 8 tokens, layer 1 is global): three groups of one cache layer, each request with a block table per group,
give the logits of one group over three cache layers, on every attention backend that runs here (Triton under
its interpreter on a CPU): a chunked prompt in scattered blocks batched with another sequence's decodes."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot.engine.scheduler_output import NewRequestData, RunningRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.model.loader import load_model
from kvpilot.model.runner import ModelRunner
from kvpilot.sampling_params import SamplingParams
from tests.model.triton_cases import ON_GPU, TRITON_SKIP_REASON

CONFIG = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 3,
          "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 256, "sliding_window": 8,
          "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
          "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "float32"}
PROMPT = [(17 * i + 3) % 500 for i in range(30)]
# group 0's tables (the only ones with one group); groups 1 and 2 take other blocks of the same pool
TABLES = {"a": [9, 2, 14, 5, 11, 0, 13, 30], "b": [3, 15, 7, 1, 12, 6, 8, 4]}
EXTRA = {rid: ([b + 16 for b in ids[::-1]], [b + 32 for b in ids]) for rid, ids in TABLES.items()}


def _steps(grouped: bool) -> list[SchedulerOutput]:
    extra = EXTRA if grouped else {rid: () for rid in TABLES}
    news = [NewRequestData(rid, PROMPT, [], SamplingParams(), TABLES[rid], 0, extra[rid]) for rid in ("a", "b")]
    return [SchedulerOutput([ScheduledChunk("a", 0, 9, False), ScheduledChunk("b", 0, 20, False)], new_requests=news),
            *(SchedulerOutput(list(chunks), running_requests=[RunningRequestData(c.request_id, [], c.start_position)
                                                              for c in chunks])
              for chunks in ([ScheduledChunk("a", 9, 12, True), ScheduledChunk("b", 20, 1, True)],
                             [ScheduledChunk("a", 21, 1, True), ScheduledChunk("b", 21, 1, True)]))]


def _logits(loaded, backend: str, grouped: bool) -> torch.Tensor:
    plan = loaded.config.kv_group_plan(hybrid=grouped)
    runner = ModelRunner(loaded, num_blocks=48, block_size=4, attention_backend=backend, kv_groups=plan)
    assert runner.attention.name == backend and len(runner.kv_caches) == 3
    assert len({t.data_ptr() for t in runner.kv_caches}) == (1 if grouped else 3)  # one cache layer for all groups
    steps = [runner.forward_logits(output)[1] for output in _steps(grouped)]
    return torch.cat([logits.cpu() for logits in steps[1:]])


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return load_model(str(path), load_format="dummy", dtype="float32", max_model_len=64,
                      device="cuda" if ON_GPU else "cpu")


def test_the_plan_makes_three_groups_of_one_layer(loaded):
    plan = loaded.config.kv_group_plan()
    assert plan.group_windows == (None, 8, 8) and plan.layer_groups == (1, 0, 2) and plan.num_slots == 1


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_grouped_logits_match_one_group(loaded, backend):
    if backend == "triton" and TRITON_SKIP_REASON is not None:
        pytest.skip(TRITON_SKIP_REASON)
    if backend == "cpu" and ON_GPU:
        pytest.skip("the cpu backend runs on a CPU")
    reference = _logits(loaded, "torch", grouped=False)
    torch.testing.assert_close(_logits(loaded, backend, grouped=True), reference, rtol=1e-4, atol=1e-4)
