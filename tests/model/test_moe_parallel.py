"""Tensor parallelism of mixture-of-experts models: each rank holds every expert's share of the expert width
(read as such from save_pretrained's per-expert tensors, a GGUF's stacked ones, or dummy weights) and the
whole router; two ranks (gloo, a worker process) decode greedily what one does."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.model.config import from_hf_config
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.loader import load_model
from kvpilot.model.parallel.shard_plan import ShardPlan
from tests.model.moe_gguf import write_moe_gguf
from tests.model.hf_match import save_random_hf_model
from tests.model.test_moe import _config


def _source(kind: str, tmp_path) -> tuple[str, str]:
    """(model, load_format): Mixtral's w1/w3/w2 from save_pretrained, a qwen3moe GGUF, a dummy Qwen3-MoE with
    a dense layer."""
    if kind == "safetensors":
        save_random_hf_model(_config("mixtral-8x7b"), tmp_path / "hf")
        return str(tmp_path / "hf"), "auto"
    if kind == "gguf":
        from transformers import AutoConfig, AutoModelForCausalLM

        (tmp_path / "config.json").write_text(json.dumps(_config("qwen3-30b-a3b", mlp_only_layers=[])))
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), dtype=torch.float32)
        write_moe_gguf(hf, tmp_path / "tiny.gguf", "qwen3moe")
        return str(tmp_path / "tiny.gguf"), "auto"
    path = tmp_path / "qwen3-moe.json"
    path.write_text(json.dumps(_config("qwen3-30b-a3b")))
    return str(path), "dummy"


@pytest.mark.parametrize("kind", ["safetensors", "gguf", "dummy"])
def test_each_rank_loads_its_share_of_every_expert(kind, tmp_path):
    model, load_format = _source(kind, tmp_path)
    kwargs = dict(load_format=load_format, dtype="float32", device="cpu")
    whole = load_model(model, **kwargs)
    params = {name: p.detach() for name, p in whole.model.named_parameters()}
    for rank in range(2):
        part = load_model(model, **kwargs, tp_rank=rank, tp_size=2)
        plan = ShardPlan.for_rank(whole.config, rank, 2)
        assert part.shard == plan and plan.expert_rows == slice(16 * rank, 16 * rank + 16)
        mine = dict(part.model.named_parameters())
        assert mine.keys() == params.keys()
        for name, tensor in mine.items():
            assert torch.equal(tensor, plan.take_fused(name, params[name])), f"{kind} rank {rank}: {name}"
        assert mine["layers.0.mlp.experts.gate_up_proj"].shape == (8, 32, 64)
        assert torch.equal(mine["layers.0.mlp.gate.weight"], params["layers.0.mlp.gate.weight"])  # whole router


def test_fused_gate_up_checkpoints_are_refused_under_tp():
    plan = ShardPlan.for_rank(from_hf_config(_config("mixtral-8x7b"), "tiny"), 1, 2)
    assert plan.index("model.layers.0.mlp.experts.3.down_proj.weight") == (slice(None), slice(16, 32))
    assert plan.index("model.layers.0.block_sparse_moe.experts.3.w1.weight") == (slice(16, 32),)
    assert plan.index("model.layers.0.mlp.experts.down_exps.weight") == (slice(None), slice(None), slice(16, 32))
    with pytest.raises(ModelLoadError, match="fuses gate and up: use --tensor-parallel-size 1"):
        plan.index("model.layers.0.mlp.experts.gate_up_proj")


def test_two_ranks_decode_what_one_does(tmp_path):
    model, _ = _source("dummy", tmp_path)
    prompts = [[5, 17, 3, 99, 250, 7], list(range(40, 80))]
    outputs = {}
    for tp in (1, 2):
        llm = LLM(model, load_format="dummy", dtype="float32", tensor_parallel_size=tp, kv_cache_memory="16MiB",
                  max_model_len=128, max_num_seqs=4)
        done = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        outputs[tp] = [list(o.outputs[0].token_ids) for o in done]
        if tp > 1:
            llm.engine.runner.shutdown()
    assert outputs[2] == outputs[1]
