from __future__ import annotations

import pytest

from kvpilot.fit.errors import ConfigError
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.fit.model_spec import spec_from_hf_config


def _spec(name: str):
    return spec_from_hf_config(get_hf_config(name), name)


def test_deepseek_v3_moe_and_mla_fields() -> None:
    spec = _spec("deepseek-v3")
    assert spec.moe is not None and spec.mla is not None
    assert (spec.moe.num_experts, spec.moe.num_experts_per_tok, spec.moe.num_shared_experts) == (256, 8, 1)
    assert spec.moe.num_dense_layers == 3 and spec.moe.has_router_bias
    assert (spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim, spec.mla.q_lora_rank) == (512, 64, 1536)
    assert spec.checkpoint_quantization == "fp8"


def test_sliding_windows() -> None:
    assert (_spec("mistral-7b-v0.1").sliding_window, _spec("mistral-7b-v0.1").num_sliding_layers) == (4096, 32)
    assert _spec("mistral-7b").num_sliding_layers == 0  # v0.3 has no window
    assert _spec("qwen2.5-72b").num_sliding_layers == 0  # window present but use_sliding_window is false
    assert _spec("gemma-2-9b").num_sliding_layers == 21
    layer_types = {**get_hf_config("qwen3-0.6b"), "sliding_window": 512,
                   "layer_types": ["sliding_attention", "full_attention"] * 14}
    layer_types.pop("use_sliding_window")
    assert spec_from_hf_config(layer_types).num_sliding_layers == 14


def test_architecture_flags() -> None:
    assert _spec("qwen2.5-72b").qkv_bias and not _spec("qwen2.5-72b").o_bias
    assert _spec("qwen3-8b").qk_norm and not _spec("qwen3-8b").qkv_bias
    assert _spec("llama-3.2-1b").head_dim == 64 and _spec("llama-3.2-1b").tie_word_embeddings


def test_nested_text_config_and_null_defaults() -> None:
    inner = {**get_hf_config("llama-3.2-1b"), "num_key_value_heads": None}
    spec = spec_from_hf_config({"model_type": "mllama", "text_config": inner})
    assert spec.hidden_size == 2048 and spec.num_key_value_heads == 32  # null -> one KV head per head


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_size": -1}, "hidden_size"),
    ({"num_hidden_layers": "many"}, "num_hidden_layers"),
    ({"num_key_value_heads": 7}, "does not divide"),
    ({"num_experts_per_tok": 9, "num_local_experts": 8}, "exceeds"),
])
def test_malformed_configs(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec_from_hf_config({**get_hf_config("llama-3.1-8b"), **change})


def test_non_dict_config() -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        spec_from_hf_config([1, 2])  # type: ignore[arg-type]
