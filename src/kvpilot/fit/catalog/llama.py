"""Llama-architecture models: SmolLM2, Llama 3.1 / 3.2 (config.json from their HF repos)."""

from __future__ import annotations

from typing import Any

from kvpilot.fit.catalog.entry import CatalogEntry

_LLAMA3_EOS_INSTRUCT = [128001, 128008, 128009]


def _llama3(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    rope_factor: float,
    tie_word_embeddings: bool,
    head_dim: int | None = None,
    transformers_version: str = "4.42.3",
) -> dict[str, Any]:
    """Llama 3.1/3.2 configs differ only in these fields; everything else is shared verbatim."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": list(_LLAMA3_EOS_INSTRUCT),
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": rope_factor,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "transformers_version": transformers_version,
        "use_cache": True,
        "vocab_size": 128256,
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    return config


SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 49152,
}

CONFIGS: dict[str, CatalogEntry] = {
    "smollm2-135m": CatalogEntry(
        "HuggingFaceTB/SmolLM2-135M-Instruct", SMOLLM2_135M, ("HuggingFaceTB/SmolLM2-135M",)
    ),
    "llama-3.2-1b": CatalogEntry(
        "meta-llama/Llama-3.2-1B-Instruct",
        _llama3(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            head_dim=64, rope_factor=32.0, tie_word_embeddings=True,
            transformers_version="4.45.0.dev0",
        ),
        ("meta-llama/Llama-3.2-1B",),
    ),
    "llama-3.2-3b": CatalogEntry(
        "meta-llama/Llama-3.2-3B-Instruct",
        _llama3(
            hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
            head_dim=128, rope_factor=32.0, tie_word_embeddings=True,
            transformers_version="4.45.0.dev0",
        ),
        ("meta-llama/Llama-3.2-3B",),
    ),
    "llama-3.1-8b": CatalogEntry(
        "meta-llama/Llama-3.1-8B-Instruct",
        _llama3(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            rope_factor=8.0, tie_word_embeddings=False,
        ),
        ("meta-llama/Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B-Instruct"),
    ),
    "llama-3.1-70b": CatalogEntry(
        "meta-llama/Llama-3.1-70B-Instruct",
        _llama3(
            hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
            rope_factor=8.0, tie_word_embeddings=False,
        ),
        ("meta-llama/Llama-3.1-70B", "meta-llama/Meta-Llama-3.1-70B-Instruct"),
    ),
    "llama-3.1-405b": CatalogEntry(
        "meta-llama/Llama-3.1-405B-Instruct",
        _llama3(
            hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
            num_attention_heads=128, rope_factor=8.0, tie_word_embeddings=False,
        ),
        ("meta-llama/Llama-3.1-405B", "meta-llama/Meta-Llama-3.1-405B-Instruct"),
    ),
}
