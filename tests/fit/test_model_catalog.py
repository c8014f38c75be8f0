from __future__ import annotations

import pytest

from kvpilot.fit.model_catalog import UnknownModelError, get_hf_config, get_repo_id, list_models

REQUIRED = [
    "smollm2-135m", "qwen3-0.6b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen2.5-72b",
    "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "mistral-7b",
    "mixtral-8x7b", "deepseek-v3", "gemma-2-9b",
]


def test_catalog_has_the_required_models_with_lowercase_names() -> None:
    names = list_models()
    assert set(REQUIRED) <= set(names)
    assert all(name == name.lower() for name in names)


@pytest.mark.parametrize("alias", ["SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct",
                                   "huggingfacetb/smollm2-135m-instruct", " smollm2-135m "])
def test_get_hf_config_accepts_short_names_and_repo_ids_case_insensitively(alias: str) -> None:
    assert get_hf_config(alias)["hidden_size"] == 576


def test_repo_ids_resolve() -> None:
    assert get_hf_config("Qwen/Qwen3-0.6B")["num_hidden_layers"] == 28
    assert get_hf_config("meta-llama/Llama-3.2-1B-Instruct")["head_dim"] == 64
    assert get_repo_id("llama-3.1-8b") == "meta-llama/Llama-3.1-8B-Instruct"


def test_get_hf_config_returns_a_deep_copy() -> None:
    config = get_hf_config("llama-3.1-8b")
    config["rope_scaling"]["factor"] = 1.0
    config["hidden_size"] = 1
    fresh = get_hf_config("llama-3.1-8b")
    assert fresh["rope_scaling"]["factor"] == 8.0
    assert fresh["hidden_size"] == 4096


def test_unknown_model_lists_close_matches() -> None:
    with pytest.raises(UnknownModelError, match=r"Did you mean: llama-3\.1-8b") as info:
        get_hf_config("lama-3.1-8b")
    assert isinstance(info.value, ValueError)


def test_real_config_values_spot_checks() -> None:
    llama = get_hf_config("llama-3.1-70b")
    assert llama["rope_scaling"] == {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    assert (llama["num_key_value_heads"], llama["intermediate_size"]) == (8, 28672)
    deepseek = get_hf_config("deepseek-v3")
    assert (deepseek["kv_lora_rank"], deepseek["qk_rope_head_dim"], deepseek["n_routed_experts"]) == (512, 64, 256)
    gemma = get_hf_config("gemma-2-9b")
    assert (gemma["head_dim"], gemma["sliding_window"], gemma["query_pre_attn_scalar"]) == (256, 4096, 256)
    qwen_moe = get_hf_config("qwen3-30b-a3b")
    moe = (qwen_moe["num_experts"], qwen_moe["num_experts_per_tok"], qwen_moe["moe_intermediate_size"])
    assert moe == (128, 8, 768)


@pytest.mark.slow
@pytest.mark.parametrize("name", list_models())
def test_every_config_loads_as_a_transformers_config(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = get_hf_config(name)
    hf = transformers.CONFIG_MAPPING[config["model_type"]](**{k: v for k, v in config.items() if k != "auto_map"})
    assert hf.hidden_size == config["hidden_size"]
    assert hf.num_hidden_layers == config["num_hidden_layers"]
