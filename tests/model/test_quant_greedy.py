"""Greedy output of the embedded GGUF with its Q4_1 / Q8_0 weights kept packed equals the float32
dequantized model's on the HF reference test's prompts; where a near-tie flips a token, the reference's
top-2 logit gap there is under 1e-3 relative (rounding, not a kernel error, decided it)."""

from __future__ import annotations

import pytest
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.model.quant.kernel import get_quant_kernel
from tests.model.test_hf_reference import NUM_NEW_TOKENS, _prompts

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")]


def _near_tie_gap(hf_model, ids: list[int]) -> float:
    """The reference's relative gap between its top-2 next-token logits after `ids`."""
    with torch.inference_mode():
        top = hf_model(torch.tensor([ids])).logits[0, -1].double().topk(2).values
    return float((top[0] - top[1]) / top[0].abs())


def test_packed_greedy_matches_dequantized(request, llm_fp32, fp32_greedy):
    # The packed model is the session's llm_fp32 (float32, 1 GiB KV, max_model_len 4096: `auto` keeps the GGUF's
    # blocks packed, as --quantization gguf does), whose greedy outputs on these prompts fp32_greedy holds.
    dense = LLM(quantization="none", dtype="float32", kv_cache_memory="1GiB", max_model_len=4096)
    assert llm_fp32.loaded.quantization == "gguf" and dense.loaded.quantization == "none"
    prompts = _prompts(dense.tokenizer)
    assert [o.prompt_token_ids for o in fp32_greedy] == prompts
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    num_flips = 0
    for prompt, got, want in zip(prompts, fp32_greedy, dense.generate(prompts, params)):
        got_ids, want_ids = got.outputs[0].token_ids, want.outputs[0].token_ids
        assert len(got_ids) == len(want_ids) == NUM_NEW_TOKENS
        if got_ids == want_ids:
            continue
        num_flips += 1
        first = next(i for i, (a, b) in enumerate(zip(got_ids, want_ids)) if a != b)
        gap = _near_tie_gap(request.getfixturevalue("hf_model"), prompt + want_ids[:first])
        assert gap < 1e-3, f"prompt of {len(prompt)} tokens diverged at {first} with a top-2 gap of {gap:.2e}"
    assert num_flips <= 1, f"{num_flips} of {len(prompts)} prompts diverged"
