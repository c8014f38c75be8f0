"""Phi-3 / Phi-4 (Phi3ForCausalLM): fused qkv_proj and gate_up_proj checkpoints, LongRoPE and Phi-4-mini's partial
rotary, token for token against HF transformers on tiny random models through LLM.generate (batching, prefix
caching, preemption). Prompts end below LongRoPE's threshold (original_max_position_embeddings = 32) and
generations run past it: there kvpilot's per-position rule is HF's (kvpilot.model.layers.rope_scaling)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from kvpilot import LLM
from kvpilot.model.config import from_hf_config
from kvpilot.model.errors import ModelLoadError
from tests.model.hf_match import (assert_batch_matches, assert_preempted_matches, assert_prefix_hit_matches,
                                  prompt_ids, save_random_hf_model)

PHI3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "num_hidden_layers": 2, "hidden_size": 64,
        "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
        "original_max_position_embeddings": 32, "sliding_window": 2047, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
        # Phi-3-mini-128k's shape of factors: short near 1, long growing with the pair index (8 pairs)
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.01, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0],
                         "long_factor": [1.0, 1.2, 1.9, 3.1, 5.0, 8.0, 12.5, 19.0]}}
# Phi-4-mini's layout: 3/4 of each head rotates (6 of 8 pairs), grouped KV heads, tied embeddings
PHI4_MINI = {**PHI3, "num_key_value_heads": 2, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
             "sliding_window": None,
             "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.02, 1.1, 1.2, 1.35, 1.5],
                              "long_factor": [1.0, 1.3, 2.1, 3.7, 6.0, 9.5]}}


def test_phi3_longrope_matches_transformers(tmp_path) -> None:
    hf = save_random_hf_model(PHI3, tmp_path / "phi3")
    llm = LLM(model=str(tmp_path / "phi3"), dtype="float32", kv_cache_memory="4MiB")
    assert llm.loaded.config.family == "phi3" and llm.loaded.config.rotary_dim == 16
    prompts = prompt_ids([1, 9, 20, 31], PHI3["vocab_size"])
    assert_batch_matches(llm, hf, prompts, 20, "phi3 longrope")
    shared = prompt_ids([18], PHI3["vocab_size"], seed=4)[0]
    assert_prefix_hit_matches(llm, hf, shared, [[3, 4], [5]], 20, "phi3 longrope")


def test_phi4_mini_partial_rotary_matches_transformers(tmp_path) -> None:
    hf = save_random_hf_model(PHI4_MINI, tmp_path / "phi4-mini")
    llm = LLM(model=str(tmp_path / "phi4-mini"), dtype="float32", kv_cache_memory="4MiB")
    assert llm.loaded.config.rotary_dim == 12 and llm.loaded.model.rotary.cos.shape[-1] == 12
    prompts = prompt_ids([2, 16, 25, 30], PHI4_MINI["vocab_size"])
    assert_batch_matches(llm, hf, prompts, 20, "phi4-mini")
    shared = prompt_ids([20], PHI4_MINI["vocab_size"], seed=6)[0]
    assert_prefix_hit_matches(llm, hf, shared, [[9], [8, 7]], 16, "phi4-mini")
    # 2 layers x 2 KV heads x 16 x (K, V) x 4 bytes = 512 B/token: 32 KiB holds 64 tokens, the 4 requests 153
    assert_preempted_matches(llm, hf, prompts, 20, "32KiB", 64, "phi4-mini")


def test_phi3_config_errors() -> None:
    with pytest.raises(ModelLoadError, match=r"hidden_act 'gelu' is not supported for Phi-3 models"):
        from kvpilot.model.models.phi3 import Phi3ForCausalLM

        Phi3ForCausalLM(from_hf_config({**PHI3, "hidden_act": "gelu"}), 16)
    with pytest.raises(ModelLoadError, match=r"longrope short_factor/long_factor have 6 entries"):
        from_hf_config({**PHI3, "rope_scaling": PHI4_MINI["rope_scaling"]})


def _write_phi3_gguf(model, path: Path) -> None:
    """A GGUF of an HF Phi3ForCausalLM laid out as llama.cpp's converter writes it: fused attn_qkv and ffn_up
    (gate then up), no Q/K permutation (Phi-3 rotates NEOX-style), the LongRoPE factors as tensors, float32."""
    from gguf import GGUFWriter

    config, writer = model.config, GGUFWriter(str(path), "phi3")
    head_dim = config.hidden_size // config.num_attention_heads
    rope, rotary_dim = config.rope_parameters, int(head_dim * config.rope_parameters["partial_rotary_factor"])
    scale = config.max_position_embeddings / config.original_max_position_embeddings
    for add, value in ((writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps), (writer.add_vocab_size, config.vocab_size),
                       (writer.add_rope_dimension_count, rotary_dim), (writer.add_rope_freq_base, rope["rope_theta"]),
                       (writer.add_rope_scaling_orig_ctx_len, config.original_max_position_embeddings),
                       (writer.add_rope_scaling_attn_factors,
                        math.sqrt(1 + math.log(scale) / math.log(config.original_max_position_embeddings))),
                       (writer.add_bos_token_id, config.bos_token_id), (writer.add_eos_token_id, config.eos_token_id)):
        add(value)
    writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get(hf_name)
        if name is None:  # model.layers.<i>.<module>.<kind>
            _, _, layer, rest = hf_name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            name = f"blk.{layer}.{names[module]}.{kind}"
        writer.add_tensor(name, np.ascontiguousarray(tensor.detach().float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_phi4_mini_gguf_matches_transformers(tmp_path) -> None:
    """The same tiny Phi-4-mini as a llama.cpp-layout GGUF: rope dimension count, LongRoPE factor tensors and
    fused tensors map back to the HF model, token for token."""
    hf = save_random_hf_model(PHI4_MINI, tmp_path / "phi4-mini")
    _write_phi3_gguf(hf.model, tmp_path / "phi4-mini.gguf")
    llm = LLM(model=str(tmp_path / "phi4-mini.gguf"), dtype="float32", kv_cache_memory="4MiB")
    config = llm.loaded.config
    assert (config.family, config.rotary_dim, config.rope_scaling.rope_type) == ("phi3", 12, "longrope")
    assert config.rope_scaling.attention_factor is None  # the stored factor is HF's default: computed exactly
    assert_batch_matches(llm, hf, prompt_ids([3, 12, 30], PHI4_MINI["vocab_size"]), 16, "phi4-mini gguf")
