"""Greedy output of kvpilot equals HF transformers token for token (fp32, the embedded GGUF), with all
prompts generated together in one batch through the paged KV cache.

HF's side is read by teacher forcing: one forward pass over the prompt and kvpilot's tokens gives HF's greedy
choice after every prefix, and those choices are kvpilot's tokens exactly when HF's own greedy loop
(tests.model.reference.hf_greedy) would generate them, since each is made on the same prefix. One pass a
prompt instead of 48 cached decode steps (the loop gave the same 8 x 48 tokens here, 2026-11-29).
"""

from __future__ import annotations

import pytest
import torch

from kvpilot import SamplingParams
from tests.model.reference import long_text

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


def hf_choices(hf_model, prompt: list[int], generated: list[int]) -> list[int]:
    """HF's greedy (argmax) token after `prompt` and after each of `generated`'s tokens but the last, from one
    forward pass: len(generated) choices, the i-th made on prompt + generated[:i]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + generated[:-1]]), logits_to_keep=len(generated)).logits[0]
    return logits.argmax(-1).tolist()


@pytest.mark.slow
def test_batched_greedy_matches_transformers(llm_fp32, fp32_greedy, hf_model):
    prompts = _prompts(llm_fp32.tokenizer)
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] == 1 and lengths[-1] >= 900, lengths  # covers 1 to ~1,000 tokens
    outputs = fp32_greedy  # llm_fp32.generate(prompts) in one batch, greedy (tests/model/conftest.py)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs):
        assert output.prompt_token_ids == prompt
        generated = output.outputs[0].token_ids
        assert output.outputs[0].finish_reason == "length" and len(generated) == NUM_NEW_TOKENS
        expected = hf_choices(hf_model, prompt, generated)
        first = next((i for i, (a, b) in enumerate(zip(generated, expected)) if a != b), None)
        assert first is None, f"prompt of {len(prompt)} tokens diverged from transformers at token {first}"


@pytest.mark.slow
def test_known_answer(llm_fp32):
    output = llm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32))[0]
    assert output.outputs[0].text == "The capital of France is Paris."
    assert output.outputs[0].finish_reason == "stop"
