"""Qwen models: Qwen3 dense and MoE, Qwen2.5-72B (config.json from their HF repos)."""

from __future__ import annotations

from typing import Any

from kvpilot.fit.catalog.entry import CatalogEntry


def _qwen3_common(num_hidden_layers: int, tie_word_embeddings: bool) -> dict[str, Any]:
    """Fields every Qwen3 config.json carries with the same values."""
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 40960,
        "max_window_layers": num_hidden_layers,
        "num_hidden_layers": num_hidden_layers,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def _qwen3_dense(
    *, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
    num_attention_heads: int, num_key_value_heads: int, tie_word_embeddings: bool,
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        **_qwen3_common(num_hidden_layers, tie_word_embeddings),
    }


def _qwen3_moe(
    *, hidden_size: int, intermediate_size: int, moe_intermediate_size: int,
    num_hidden_layers: int, num_attention_heads: int, num_key_value_heads: int,
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "decoder_sparse_step": 1,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "mlp_only_layers": [],
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": True,
        "num_attention_heads": num_attention_heads,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_key_value_heads": num_key_value_heads,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        **_qwen3_common(num_hidden_layers, tie_word_embeddings=False),
    }


QWEN25_72B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 29568,
    "max_position_embeddings": 32768,
    "max_window_layers": 70,
    "model_type": "qwen2",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

CONFIGS: dict[str, CatalogEntry] = {
    "qwen3-0.6b": CatalogEntry(
        "Qwen/Qwen3-0.6B",
        _qwen3_dense(
            hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
        ),
    ),
    "qwen3-8b": CatalogEntry(
        "Qwen/Qwen3-8B",
        _qwen3_dense(
            hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
        ),
    ),
    "qwen3-32b": CatalogEntry(
        "Qwen/Qwen3-32B",
        _qwen3_dense(
            hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
            num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
        ),
    ),
    "qwen3-30b-a3b": CatalogEntry(
        "Qwen/Qwen3-30B-A3B",
        _qwen3_moe(
            hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        ),
    ),
    "qwen3-235b-a22b": CatalogEntry(
        "Qwen/Qwen3-235B-A22B",
        _qwen3_moe(
            hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
            num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
        ),
    ),
    "qwen2.5-72b": CatalogEntry("Qwen/Qwen2.5-72B-Instruct", QWEN25_72B),
}
