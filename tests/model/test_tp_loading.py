"""Shard-aware loading (#15): a tensor-parallel rank reads only its part of each weight, from safetensors,
GGUF and dummy draws alike, and that part is exactly the one-rank model's slice (its heads' rows of q/k/v,
its MLP rows of gate/up, the matching columns of o_proj and down_proj; replicated KV heads when there are
fewer than the ranks). Two ranks on a GGUF decode what one does."""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvpilot import LLM, SamplingParams
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.model.config import from_hf_config
from kvpilot.model.loader import load_model
from kvpilot.model.parallel.shard_plan import ShardPlan
from tests.model.hf_match import save_random_hf_model
from tests.model.test_gguf_types import _write_gguf

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "vocab_size": 512,
         "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def _hf_config(name: str, heads: int, kv_heads: int) -> dict:
    config = {**get_hf_config(name), **SMALL, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    config.pop("dtype", None)
    return config


def _model_source(kind: str, tmp_path) -> tuple[str, str]:
    """(model, load_format) of a small model in each format; Qwen2 (qkv bias) for safetensors."""
    if kind == "safetensors":
        save_random_hf_model(_hf_config("qwen2.5-72b", 4, 2), tmp_path / "hf")
        return str(tmp_path / "hf"), "auto"
    if kind == "gguf":
        path = tmp_path / "tiny.gguf"
        _write_gguf(path, T.Q8_0)  # 4 heads, 2 KV heads, the loader unpermutes q/k before a rank's slice
        return str(path), "auto"
    path = tmp_path / "qwen3.json"  # 1 KV head: replicated on both ranks
    path.write_text(json.dumps(_hf_config("qwen3-0.6b", 4, 1)))
    return str(path), "dummy"


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach() for name, param in model.named_parameters()}


@pytest.mark.parametrize("kind", ["safetensors", "gguf", "dummy"])
def test_each_rank_loads_exactly_its_slice_of_the_whole_model(kind, tmp_path):
    model, load_format = _model_source(kind, tmp_path)
    kwargs = dict(load_format=load_format, dtype="float32", device="cpu", quantization="none")
    whole = load_model(model, **kwargs)
    assert whole.shard is None
    whole_params = _params(whole.model)
    for rank in range(2):
        part = load_model(model, **kwargs, tp_rank=rank, tp_size=2)
        plan = ShardPlan.for_rank(whole.config, rank, 2)
        assert part.shard == plan and part.config == whole.config  # the whole model's config, the rank's model
        part_params = _params(part.model)
        assert part_params.keys() == whole_params.keys()
        for name, tensor in part_params.items():
            assert torch.equal(tensor, plan.take_fused(name, whole_params[name])), f"{kind} rank {rank}: {name}"
        numel = sum(t.numel() for n, t in part_params.items() if ".layers." in f".{n}")
        assert numel < 0.6 * sum(t.numel() for n, t in whole_params.items() if ".layers." in f".{n}")


def test_the_plan_names_each_ranks_heads_and_mlp_rows():
    """4 query heads of 16 over 2 ranks: rows 0-31 and 32-63; 1 KV head: both ranks keep rows 0-15."""
    config = from_hf_config(_hf_config("qwen3-0.6b", 4, 1), "qwen3-0.6b")
    plans = [ShardPlan.for_rank(config, rank, 2) for rank in range(2)]
    assert [(p.q_rows.start, p.q_rows.stop) for p in plans] == [(0, 32), (32, 64)]
    assert [(p.kv_rows.start, p.kv_rows.stop) for p in plans] == [(0, 16), (0, 16)]
    assert [(p.mlp_rows.start, p.mlp_rows.stop) for p in plans] == [(0, 64), (64, 128)]
    name = "model.layers.1.self_attn.o_proj.weight"
    assert plans[1].index(name) == (slice(None), slice(32, 64))
    assert plans[1].index("model.layers.1.mlp.down_proj.weight") == (slice(None), slice(64, 128))
    assert plans[0].index("model.layers.0.self_attn.k_proj.bias") == (slice(0, 16),)
    assert plans[0].index("model.embed_tokens.weight") is None and plans[0].index("lm_head.weight") is None


def test_two_ranks_on_a_gguf_decode_what_one_does(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, T.Q8_0)
    prompts = [[5, 17, 3, 99, 250, 7], list(range(40, 80))]
    outputs = {}
    for tp in (1, 2):
        llm = LLM(str(path), dtype="float32", quantization="none", tensor_parallel_size=tp,
                  kv_cache_memory="16MiB", max_model_len=128, max_num_seqs=4)
        done = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        outputs[tp] = [list(o.outputs[0].token_ids) for o in done]
        if tp > 1:
            llm.engine.runner.shutdown()
    assert outputs[2] == outputs[1]
