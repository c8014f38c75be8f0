"""Fixtures of the model tests on the real embedded model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import torch_threads

# The files that call the C++ kernels themselves: at least two threads, so each kernel's split of its work across
# threads runs (scripts/test.sh gives the suite's engines one thread each beside the other pytest worker).
KERNEL_TEST_FILES = frozenset((
    "test_attention_variants.py", "test_cpu_kernels.py", "test_decode_kernel.py", "test_fused_decode.py",
    "test_moe_packed.py", "test_norm_kernel.py", "test_prefill_kernel.py", "test_quant_kernels.py",
    "test_quant_kquant.py", "test_quant_tile_blocks.py", "test_quant_tiled.py", "test_quant_tiled_argmax.py"))


@pytest.fixture(autouse=True, scope="module")
def _kernel_tests_split_across_threads(request: pytest.FixtureRequest) -> Iterator[None]:
    if Path(str(request.node.path)).name not in KERNEL_TEST_FILES:
        yield
        return
    with torch_threads(2):
        yield


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
