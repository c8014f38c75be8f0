"""Greedy decoding with HF transformers itself: the reference kvpilot must match token for token."""

from __future__ import annotations

import inspect

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], num_new_tokens: int) -> list[int]:
    """Plain greedy loop over transformers' forward with its own KV cache (no stop on EOS)."""
    # transformers 5.x names the cache `cache` (`past_key_values` warns, and goes in 5.40); 4.x only knows the old
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    generated = []
    for _ in range(num_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), use_cache=True, **{name: out[name]})
    return generated


PARAGRAPH = ("The history of computing is a story of abstractions stacked on abstractions. Early machines were "
             "programmed by rewiring panels; later, stored programs let the same hardware run many tasks. "
             "Compilers turned readable code into instructions, and operating systems shared one machine among "
             "many users. Networks then joined machines together, and the web made documents link to each other "
             "across the world. ")


def long_text(num_paragraphs: int) -> str:
    return "".join(f"Section {i + 1}. {PARAGRAPH}" for i in range(num_paragraphs))
