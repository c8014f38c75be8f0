"""Mistral's sliding window end to end through the attention backends: a tiny random-weight
MistralForCausalLM (2 layers, window 8) whose prompts are ~5x the window, greedy through LLM.generate token for
token against HF transformers in float32, with the torch and the cpu (C++ kernel) backends. Small chunks of
prefill (chunks after the first start past the window), blocks of 4 and prompts sharing a prefix (prefix-cache
hits) exercise prompt chunks with start > 0 as well as decodes."""

from __future__ import annotations

import pytest

from kvpilot import LLM, SamplingParams
from tests.model.reference import hf_greedy
from tests.model.hf_match import save_random_hf_model
from tests.model.test_architectures import _small_config

WINDOW = 8
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    cfg = _small_config("mistral-7b-v0.1")
    cfg["sliding_window"] = WINDOW
    directory = tmp_path_factory.mktemp("mistral-window")
    hf = save_random_hf_model(cfg, directory).model
    vocab = cfg["vocab_size"]
    shared = [(j * 13 + 5) % vocab for j in range(24)]
    prompts = [[(i * 37 + j * 11) % vocab for j in range(n)] for i, n in enumerate([40, 37, 3])]
    prompts += [shared + prompts[0][:17], shared + prompts[1][:15]]  # 24 shared tokens: a prefix-cache hit
    return directory, prompts, [hf_greedy(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_windowed_mistral_matches_transformers(mistral, backend):
    directory, prompts, expected = mistral
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory="4MiB", block_size=4, max_model_len=128,
              max_num_seqs=4, max_num_batched_tokens=16, attention_backend=backend)
    assert llm.loaded.config.layer_window(0) == WINDOW
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, output, ids in zip(prompts, outputs, expected):
        assert output.outputs[0].token_ids == ids, f"a prompt of {len(prompt)} tokens diverged ({backend})"
