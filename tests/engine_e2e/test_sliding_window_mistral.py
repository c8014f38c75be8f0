"""A sliding-window model end to end: a tiny random-weight MistralForCausalLM (every layer slides over 16 tokens)
through LLM.generate, token for token against HF transformers in float32, with prompts much longer than the
window on a KV pool far too small to hold them whole: the KV manager releases the blocks that fell out of
the window (placeholders in the block table), with continuous batching, prefix hits and preemption on."""

from __future__ import annotations

import pytest

from kvpilot import LLM, SamplingParams
from tests.model.reference import hf_greedy
from tests.model.hf_match import save_random_hf_model
from tests.model.test_architectures import _small_config

WINDOW = 16
BLOCK_SIZE = 4
NUM_BLOCKS = 20  # 80 tokens; the longest request has 150 + 24 (44 blocks without the window)
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head dim 16, float32
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    cfg = _small_config("mistral-7b-v0.1")
    cfg["sliding_window"] = WINDOW
    directory = tmp_path_factory.mktemp("mistral-sliding")
    hf = save_random_hf_model(cfg, directory).model
    return cfg, directory, hf


def _prompts(vocab_size: int) -> list[list[int]]:
    shared = [(j * 13 + 5) % vocab_size for j in range(100)]
    lengths = [5, 40, 90, 150, 61]
    prompts = [[(i * 37 + j * 11) % vocab_size for j in range(n)] for i, n in enumerate(lengths)]
    return [*prompts, shared + prompts[1][:50], shared + prompts[2][:30]]  # the last two share 100 tokens


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_windowed_mistral_matches_transformers_on_a_small_pool(mistral, backend):
    cfg, directory, hf = mistral
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory=NUM_BLOCKS * BYTES_PER_BLOCK,
              block_size=BLOCK_SIZE, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=32,
              attention_backend=backend)
    scheduler = llm.engine.scheduler
    assert scheduler.cache_config.sliding_window == WINDOW and scheduler.cache_config.num_blocks == NUM_BLOCKS
    prompts = _prompts(cfg["vocab_size"])
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS), \
            f"a prompt of {len(prompt)} tokens diverged ({backend})"
    stats = scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    scheduler.check_integrity()
    assert stats.num_used_blocks == 0
