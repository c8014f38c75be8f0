"""OpenAI's gpt-oss (config.json from their HF repos: MXFP4 experts, alternating sliding / full attention, YaRN)."""

from __future__ import annotations

from typing import Any

from kvpilot.fit.catalog.entry import CatalogEntry


def _gpt_oss(*, num_hidden_layers: int, num_local_experts: int) -> dict[str, Any]:
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (num_hidden_layers // 2),
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": 8,
        "num_local_experts": num_local_experts,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": 201088,
    }


CONFIGS: dict[str, CatalogEntry] = {
    "gpt-oss-20b": CatalogEntry("openai/gpt-oss-20b", _gpt_oss(num_hidden_layers=24, num_local_experts=32)),
    "gpt-oss-120b": CatalogEntry("openai/gpt-oss-120b", _gpt_oss(num_hidden_layers=36, num_local_experts=128)),
}
