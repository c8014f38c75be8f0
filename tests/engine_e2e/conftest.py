"""Fixtures for engine tests on the real embedded model: a reference that runs each prompt alone (no prefix
cache), 32 prompts of mixed lengths and two waves sharing a prefix, with their outputs alone (computed once a
session for the batching and speculative tests)."""

from __future__ import annotations

import pytest

from kvpilot import LLM, SamplingParams
from tests.model.reference import long_text

NUM_NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
# 1 to 200 tokens (1 to 13 blocks of 16): prefill is most of a CPU run's cost, and batching, chunking and
# preemption do the same with prompts twice as long
PROMPT_LENGTHS = [1, 8, 20, 32, 45, 60, 75, 100, 130, 165, 200, 2, 16, 24, 37, 50,
                  65, 85, 110, 145, 180, 4, 12, 28, 40, 55, 70, 92, 120, 155, 6, 35]


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


def prefix_waves(corpus_ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Two waves of prompts sharing a 150-token prefix (9 full blocks of 16, then 6 tokens): 3, then 5 that
    should each find the 9 blocks cached."""
    shared = corpus_ids[:150]
    first = [shared + corpus_ids[400 + 10 * i: 405 + 10 * i] for i in range(3)]
    second = [shared + corpus_ids[600 + 10 * i: 608 + 10 * i] for i in range(5)]
    return first, second


@pytest.fixture(scope="session")
def second_wave_alone(reference_llm, corpus_ids) -> list[list[int]]:
    return run_alone(reference_llm, prefix_waves(corpus_ids)[1])


def generate_with_steps(llm: LLM, prompts, params: SamplingParams = GREEDY):
    """(llm.generate's outputs, the StepStats of every step it ran)."""
    steps = []
    llm.engine.on_step = steps.append
    try:
        return llm.generate(prompts, params), steps
    finally:
        llm.engine.on_step = None


def assert_no_leak(llm: LLM) -> None:
    """Idle engine: invariants hold and no block is still in use."""
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    stats = scheduler.make_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_used_blocks == 0, stats
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
