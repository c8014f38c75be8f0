"""RoPE scaling (linear, dynamic NTK, yarn, longrope, llama3): the per-position frequencies and attention factor
equal what transformers' ROPE_INIT_FUNCTIONS give for the same config, the parser reads every field with HF's
defaults, max_model_len reaches the scaled context, and tiny random models decode token for token as HF does
(Qwen3 with YaRN, Llama with linear and with dynamic scaling, the latter run past its threshold)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpilot import LLM
from kvpilot.fit.errors import GgufError
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.model.config import from_hf_config
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.layers.rope_scaling import rotary_angles
from tests.model.hf_match import (assert_batch_matches, assert_preempted_matches, assert_prefix_hit_matches,
                                  prompt_ids, save_random_hf_model)

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2,
         "torch_dtype": "float32"}
LONG_FACTORS = [1.0, 1.3, 2.1, 3.7, 6.0, 9.5]  # 6 pairs: head_dim 16 at partial_rotary_factor 0.75
SHORT_FACTORS = [1.0, 1.02, 1.1, 1.2, 1.35, 1.5]

# name -> (model family, config overrides); max_position_embeddings 64 throughout, positions checked to 199
UNIT_CASES = {
    "linear": ("llama-3.2-1b", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "dynamic": ("llama-3.2-1b", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama3": ("llama-3.2-1b", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "yarn": ("qwen3-0.6b", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 16}}),
    "yarn-deepseek-mscale": ("qwen3-0.6b", {"rope_scaling": {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "mscale": 1.0,
        "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}}),
    "yarn-untruncated": ("qwen3-0.6b", {"rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 16, "truncate": False,
        "beta_fast": 32.0, "beta_slow": 1.0}}),
    "longrope-partial": ("phi3", {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 32,
                                  "rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTORS,
                                                   "long_factor": LONG_FACTORS}}),
}


def _config(family: str, overrides: dict, max_positions: int = 64) -> dict:
    if family == "phi3":
        cfg = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    else:
        cfg = get_hf_config(family)
    cfg.update(SMALL)
    cfg.pop("dtype", None)
    cfg["max_position_embeddings"] = max_positions
    cfg.update(overrides)
    return {key: value for key, value in cfg.items() if value is not None}  # None: leave the key out


def _hf_config(cfg: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(**cfg)


def _hf_inv_freq(hf_cfg, rope_type: str, seq_len: int) -> tuple[torch.Tensor, float]:
    """The frequencies transformers uses in a forward pass whose last position is seq_len - 1 (its
    dynamic_rope_update: dynamic recomputes only past max_position_embeddings, longrope picks by length)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    if rope_type == "dynamic":
        beyond = seq_len > hf_cfg.max_position_embeddings
        return init(hf_cfg, None, seq_len=torch.tensor(seq_len)) if beyond else init(hf_cfg, None)
    return init(hf_cfg, None, seq_len=seq_len)


@pytest.mark.parametrize("name", list(UNIT_CASES))
def test_angles_and_attention_factor_match_transformers(name: str) -> None:
    family, overrides = UNIT_CASES[name]
    cfg = _config(family, overrides)
    config = from_hf_config(cfg, name)
    angles, attention_factor = rotary_angles(config.rope_theta, config.rotary_dim, config.rope_scaling, 200)
    hf_cfg = _hf_config(cfg)
    assert angles.shape == (200, config.rotary_dim // 2)
    for position in (0, 1, 15, 16, 31, 32, 33, 63, 64, 65, 100, 199):
        inv_freq, hf_factor = _hf_inv_freq(hf_cfg, config.rope_scaling.rope_type, position + 1)
        assert torch.equal(angles[position], float(position) * inv_freq), f"{name}: position {position}"
        assert attention_factor == pytest.approx(hf_factor, rel=1e-12), name


def test_parser_fills_hf_defaults() -> None:
    qwen = from_hf_config(_config("qwen3-0.6b", {"max_position_embeddings": 40960, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}))
    assert (qwen.rope_scaling.beta_fast, qwen.rope_scaling.beta_slow, qwen.rope_scaling.truncate) == (32.0, 1.0, True)
    assert qwen.max_position_embeddings == 131072  # Qwen3 states the pre-YaRN length: 4 x 32768
    # Phi-3-mini-128k: "su" (old name), no factor (HF: max / original), original length at the top level
    phi = from_hf_config(_config("phi3", {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                                          "partial_rotary_factor": 0.75, "rope_scaling": {
                                              "type": "su", "short_factor": SHORT_FACTORS,
                                              "long_factor": LONG_FACTORS}}))
    assert phi.rope_scaling.rope_type == "longrope" and phi.rope_scaling.factor == 32.0
    assert (phi.rope_scaling.original_max_position_embeddings, phi.max_position_embeddings) == (4096, 131072)
    assert (phi.rotary_dim, phi.rope_scaling.long_factor) == (12, tuple(LONG_FACTORS))
    dynamic = from_hf_config(_config("llama-3.2-1b", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    assert (dynamic.rope_scaling.original_max_position_embeddings, dynamic.max_position_embeddings) == (64, 128)
    linear = from_hf_config(_config("llama-3.2-1b", {"rope_scaling": None, "rope_theta": None, "rope_parameters": {
        "rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}}))  # the transformers 5 layout
    assert (linear.rope_theta, linear.max_position_embeddings) == (5e5, 256)
    yarn = from_hf_config(_config("llama-3.2-1b", {"rope_scaling": {  # gpt-oss states the scaled length
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}}))
    assert yarn.max_position_embeddings == 64 and from_hf_config(_config("llama-3.2-1b", {})).rotary_dim == 16


def test_unrunnable_scaling_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match=r"short_factor/long_factor have 6 entries; the model rotates 8"):
        from_hf_config(_config("phi3", {"rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTORS,
                                                         "long_factor": LONG_FACTORS}}))
    with pytest.raises(ModelLoadError, match=r"rope scaling type 'mrope' is not supported \(supported: llama3, "):
        from_hf_config(_config("qwen3-0.6b", {"rope_scaling": {"rope_type": "mrope", "factor": 1.0}}))
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor 0.1 rotates 1 of head_dim 16"):
        from_hf_config(_config("phi3", {"partial_rotary_factor": 0.1}))


def test_qwen3_yarn_matches_transformers(tmp_path) -> None:
    """YaRN with Qwen3's layout (original length below max_position_embeddings), prompts past both."""
    cfg = _config("qwen3-0.6b", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32}}, max_positions=40)
    hf = save_random_hf_model(cfg, tmp_path / "qwen3-yarn")
    llm = LLM(model=str(tmp_path / "qwen3-yarn"), dtype="float32", kv_cache_memory="4MiB")
    assert llm.loaded.config.max_position_embeddings == 128  # the scaled context, the default max_model_len
    assert_batch_matches(llm, hf, prompt_ids([1, 9, 45, 90], cfg["vocab_size"]), 16, "qwen3 yarn")


def test_llama_linear_matches_transformers(tmp_path) -> None:
    cfg = _config("llama-3.2-1b", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    hf = save_random_hf_model(cfg, tmp_path / "llama-linear")
    llm = LLM(model=str(tmp_path / "llama-linear"), dtype="float32", kv_cache_memory="4MiB")
    prompts = prompt_ids([3, 17, 50, 100], cfg["vocab_size"])
    assert_batch_matches(llm, hf, prompts, 16, "llama linear")
    shared = prompt_ids([40], cfg["vocab_size"], seed=5)[0]
    assert_prefix_hit_matches(llm, hf, shared, [[7, 8], [9], [10, 11, 12]], 12, "llama linear")


def test_llama_dynamic_matches_transformers_past_its_threshold(tmp_path) -> None:
    """Prompts within max_position_embeddings (64), generations running past it: HF recomputes the base at
    every decoded position there, as kvpilot's per-position table holds it; exact under preemption too."""
    cfg = _config("llama-3.2-1b", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    hf = save_random_hf_model(cfg, tmp_path / "llama-dynamic")
    llm = LLM(model=str(tmp_path / "llama-dynamic"), dtype="float32", kv_cache_memory="4MiB")
    prompts = prompt_ids([2, 30, 50, 60], cfg["vocab_size"])
    assert_batch_matches(llm, hf, prompts, 24, "llama dynamic")
    shared = prompt_ids([36], cfg["vocab_size"], seed=3)[0]
    assert_prefix_hit_matches(llm, hf, shared, [[1, 2, 3], [4]], 24, "llama dynamic")
    # 2 layers x 2 KV heads x 16 x (K, V) x 4 bytes = 512 B/token: 64 KiB holds 128 tokens, the 4 requests 238
    assert_preempted_matches(llm, hf, prompts, 24, "64KiB", 96, "llama dynamic")



def test_fit_plans_up_to_the_scaled_context(tmp_path) -> None:
    from kvpilot.fit.model_source import load_model

    cfg = _config("qwen3-0.6b", {"max_position_embeddings": 40960, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(tmp_path / "config.json")).context_length == 131072


def _gguf_fields(metadata: dict, tensors: dict | None = None) -> dict:
    from kvpilot.fit.gguf_rope import gguf_rope_fields

    return gguf_rope_fields(metadata.get, tensors or {}, {"head_dim": 16, "max_position_embeddings": 40960},
                            Path("m.gguf"))


def test_gguf_yarn_and_linear_map_to_the_hf_config() -> None:
    yarn = _gguf_fields({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.dimension_count": 16,
                         "rope.scaling.original_context_length": 32768, "rope.scaling.attn_factor": 1.0})
    hf_yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert yarn == {"rope_scaling": hf_yarn}
    base = _config("qwen3-0.6b", {"max_position_embeddings": 40960})
    assert from_hf_config({**base, **yarn}) == from_hf_config({**base, "rope_scaling": hf_yarn})
    linear = _gguf_fields({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0, "rope.dimension_count": 12})
    assert linear == {"partial_rotary_factor": 0.75, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}


@pytest.mark.parametrize("metadata, tensors, message", [
    ({}, {"rope_freqs.weight": None}, "rope_freqs tensor"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_log_multiplier": 0.1}, {},
     r"yarn_log_multiplier set is not supported"),
    ({"rope.scaling.type": "longrope"}, {}, r"'longrope' is not supported \(kvpilot maps linear and yarn"),
])
def test_gguf_scaling_kvpilot_cannot_map_is_refused(metadata, tensors, message) -> None:
    with pytest.raises(GgufError, match=message):
        _gguf_fields(metadata, tensors)
