"""`fit` on mixture-of-experts models: parameter counts equal transformers' own for Qwen3-MoE's dense-layer
patterns (mlp_only_layers, decoder_sparse_step), and a GGUF's experts are sized from its tensors, so memory
follows all experts while the batch-1 decode reads only the routed ones."""

from __future__ import annotations

import json

import pytest

from kvpilot.fit.hardware import parse_device_arg
from kvpilot.fit.memory import plan_memory
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.fit.model_source import load_model
from kvpilot.fit.params import count_params
from kvpilot.fit.roofline import weights_read_bytes
from kvpilot.fit.model_spec import spec_from_hf_config
from kvpilot.fit.workload import FitInputs

TINY = {"num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "num_experts": 8, "num_experts_per_tok": 2}


def _qwen3_moe(**overrides) -> dict:
    return {**get_hf_config("qwen3-30b-a3b"), **TINY, **overrides}


@pytest.mark.parametrize(("dense_only", "step", "num_moe_layers"), [([], 1, 6), ([0, 3], 1, 4), ([], 2, 3),
                                                                    ([1], 2, 2)])
def test_moe_layer_pattern_matches_transformers(dense_only, step, num_moe_layers):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = _qwen3_moe(mlp_only_layers=dense_only, decoder_sparse_step=step)
    params = count_params(spec_from_hf_config(cfg))
    assert params.num_moe_layers == num_moe_layers
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**cfg))
    assert params.num_total == sum(p.numel() for p in hf.parameters())
    idle = num_moe_layers * (8 - 2) * params.num_params_per_expert
    assert params.num_active == params.num_total - idle


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_gguf_experts_are_sized_from_the_file(arch, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM
    from tests.model.moe_gguf import write_moe_gguf

    cfg = _qwen3_moe() if arch == "qwen3moe" else {**get_hf_config("mixtral-8x7b"), **TINY, "num_local_experts": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    write_moe_gguf(hf, tmp_path / "tiny.gguf", arch)
    model = load_model(str(tmp_path / "tiny.gguf"))
    width = 32 if arch == "qwen3moe" else 96  # Mixtral's experts are intermediate_size wide
    assert model.spec.model_type == ("qwen3_moe" if arch == "qwen3moe" else "mixtral")
    assert model.gguf is not None and model.gguf.num_bytes_expert == 3 * width * 64 * 4  # float32
    assert model.params.num_total == model.gguf.num_params  # every tensor of the file counted, none twice
    plan = plan_memory(model, parse_device_arg("cpu"), FitInputs(dtype="bf16"))
    # kvpilot dequantizes MoE GGUFs at load (here in bf16): the float32 file's experts take half in memory
    assert plan.weights.num_bytes_expert == model.gguf.num_bytes_expert // 2
    idle = 6 * (8 - 2) * plan.weights.num_bytes_expert  # batch 1: 2 of 8 experts in each of 6 layers
    assert weights_read_bytes(model, plan, 1) == pytest.approx(plan.weights.num_bytes - plan.weights.num_bytes_embedding
                                                               - idle, rel=1e-3)
