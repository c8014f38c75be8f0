"""Fixtures for engine tests on the real embedded model: a reference that runs each prompt alone (no prefix
cache), and 32 prompts of mixed lengths."""

from __future__ import annotations

import pytest

from kvpilot import LLM, SamplingParams
from tests.model.reference import long_text

NUM_NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
PROMPT_LENGTHS = [3, 17, 40, 64, 90, 120, 150, 200, 260, 330, 400, 5, 33, 48, 75, 100,
                  130, 170, 220, 290, 360, 9, 25, 56, 80, 110, 140, 185, 240, 310, 12, 70]


@pytest.fixture(scope="session")
def corpus_ids(llm_fp32) -> list[int]:
    return llm_fp32.tokenizer.encode(long_text(12))


@pytest.fixture(scope="session")
def mixed_prompts(corpus_ids) -> list[list[int]]:
    assert len(PROMPT_LENGTHS) == 32
    return [corpus_ids[(7 * i) % 200:(7 * i) % 200 + n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="session")
def reference_llm(llm_fp32) -> LLM:
    """Same weights, prefix caching off: the 'each prompt run alone' reference."""
    return LLM(loaded=llm_fp32.loaded, enable_prefix_caching=False, kv_cache_memory="256MiB", max_model_len=2048)


def run_alone(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]


@pytest.fixture(scope="session")
def mixed_alone(reference_llm, mixed_prompts) -> list[list[int]]:
    return run_alone(reference_llm, mixed_prompts)


def assert_no_leak(llm: LLM) -> None:
    """Idle engine: invariants hold and no block is still in use."""
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    stats = scheduler.make_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_used_blocks == 0, stats
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
