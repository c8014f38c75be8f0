"""Every supported family (Llama 3 with llama3 RoPE scaling, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm)
matches HF transformers token for token on the same random weights, loaded through kvpilot's HF-directory
loader (config.json + safetensors)."""

from __future__ import annotations

import pytest

from kvpilot import LLM, SamplingParams
from kvpilot.fit.model_catalog import get_hf_config
from tests.model.hf_match import save_random_hf_model
from tests.model.reference import hf_greedy

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 16384,
         "bos_token_id": 1, "eos_token_id": 2}


def _small_config(name: str) -> dict:
    cfg = get_hf_config(name)
    cfg.update(SMALL)
    cfg["torch_dtype"] = "float32"
    cfg.pop("dtype", None)
    return cfg


@pytest.mark.parametrize("name", ["llama-3.2-1b", "mistral-7b", "qwen2.5-72b", "qwen3-0.6b"])
def test_family_matches_transformers(name, tmp_path):
    cfg = _small_config(name)
    hf = save_random_hf_model(cfg, tmp_path / name).model
    if name == "llama-3.2-1b":
        assert cfg["rope_scaling"]["rope_type"] == "llama3"
    llm = LLM(model=str(tmp_path / name), dtype="float32", kv_cache_memory="16MiB", max_model_len=512)
    assert llm.loaded.config.family == cfg["model_type"]
    prompts = [[(i * 37 + j * 11) % cfg["vocab_size"] for j in range(n)] for i, n in enumerate([1, 7, 40, 150])]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        ids = hf_greedy(hf, prompt, 24)
        assert output.outputs[0].token_ids == ids, f"{name}: prompt of {len(prompt)} tokens diverged"
