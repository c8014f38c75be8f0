"""Greedy output of kvpilot equals HF transformers token for token (fp32, the embedded GGUF), with all
prompts generated together in one batch through the paged KV cache."""

from __future__ import annotations

import pytest

from kvpilot import SamplingParams
from tests.model.reference import hf_greedy, long_text

NUM_NEW_TOKENS = 48


def _prompts(tokenizer) -> list[list[int]]:
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
        [{"role": "user", "content": "Summarize this text:\n" + long_text(3)}],
    ]
    raw = ["Hello", "The quick brown fox jumps over the lazy dog. Then", "def fibonacci(n):",
           long_text(6) + "In summary,", long_text(12) + "To conclude,"]
    return [tokenizer.encode_chat(c) for c in chats] + [tokenizer.encode(r) for r in raw]


@pytest.mark.slow
def test_batched_greedy_matches_transformers(llm_fp32, fp32_greedy, hf_model):
    prompts = _prompts(llm_fp32.tokenizer)
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] == 1 and lengths[-1] >= 900, lengths  # covers 1 to ~1,000 tokens
    outputs = fp32_greedy  # llm_fp32.generate(prompts) in one batch, greedy (tests/model/conftest.py)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].finish_reason == "length"
        expected = hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.slow
def test_known_answer(llm_fp32):
    output = llm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32))[0]
    assert output.outputs[0].text == "The capital of France is Paris."
    assert output.outputs[0].finish_reason == "stop"
