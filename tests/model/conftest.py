"""Fixtures of the model tests on the real embedded model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def fp32_greedy(llm_fp32) -> list:
    """The session's float32 model (`llm_fp32`: `auto` keeps the GGUF's Q4_1/Q8_0 weights packed) generating
    the HF reference test's prompts greedily, all in one batch: the outputs test_hf_reference checks against HF
    transformers token for token, computed once for the tests that compare other settings with them
    (test_quant_greedy, test_prompt_gemm). Read only."""
    from kvpilot import SamplingParams
    from tests.model.test_hf_reference import NUM_NEW_TOKENS, _prompts

    prompts = _prompts(llm_fp32.tokenizer)
    return llm_fp32.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True))
