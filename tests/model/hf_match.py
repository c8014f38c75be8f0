"""Token-exact checks of kvpilot against HF transformers on a tiny random-weight model: the same checkpoint
(config.json + safetensors) loaded by both, greedy outputs compared through `LLM.generate` with several
prompts at once (continuous batching), a second wave sharing a prefix with the first (prefix caching) and, on
request, a KV cache small enough to force preemption."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvpilot import LLM, SamplingParams
from tests.model.reference import hf_greedy


class HfGreedy:
    """HF's greedy tokens for a prompt (tests.model.reference.hf_greedy), each computed once per model."""

    def __init__(self, model) -> None:
        self.model = model
        self._done: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._done:
            self._done[key] = hf_greedy(self.model, prompt, max_tokens)
        return self._done[key]


def save_random_hf_model(cfg: dict, directory: Path) -> HfGreedy:
    """A real transformers model from `cfg`, every parameter randomized (norms and biases too), saved to
    `directory` (float32); returns its greedy decoder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = 0.3 if "norm" in name or name.endswith("bias") else 0.08
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + std * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory, safe_serialization=True)
    return HfGreedy(model.eval())


def prompt_ids(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Deterministic prompts of the given lengths (distinct from each other)."""
    return [[(i * 37 + j * 11 + seed) % vocab_size for j in range(n)] for i, n in enumerate(lengths)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def assert_batch_matches(llm: LLM, hf: HfGreedy, prompts: list[list[int]], max_tokens: int, label: str) -> list:
    """All prompts in one `generate`, each output equal to HF's own greedy decoding of it alone."""
    outputs = llm.generate(prompts, _greedy(max_tokens))
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf(prompt, max_tokens), \
            f"{label}: the prompt of {len(prompt)} tokens diverged from transformers"
    return outputs


def assert_prefix_hit_matches(llm: LLM, hf: HfGreedy, prefix: list[int], tails: list[list[int]], max_tokens: int,
                              label: str) -> None:
    """Two waves sharing `prefix` (at least one full KV block): the second reads it from the prefix cache and
    still decodes what HF does."""
    assert_batch_matches(llm, hf, [prefix + tails[0]], max_tokens, label)
    outputs = assert_batch_matches(llm, hf, [prefix + tail for tail in tails[1:]], max_tokens, label)
    assert all(o.num_cached_tokens > 0 for o in outputs), f"{label}: the shared prefix was not cached"


def assert_preempted_matches(llm: LLM, hf: HfGreedy, prompts: list[list[int]], max_tokens: int,
                             kv_cache_memory: str, max_model_len: int, label: str, **engine_args) -> LLM:
    """`llm`'s weights with a KV cache too small for all prompts at once (and `engine_args`): requests are
    preempted, recomputed, and still exact. Returns that LLM."""
    llm = LLM(loaded=llm.loaded, kv_cache_memory=kv_cache_memory, max_model_len=max_model_len,
              enable_prefix_caching=False, **engine_args)
    outputs = assert_batch_matches(llm, hf, prompts, max_tokens, label)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0, f"{label}: no request was preempted"
    return llm
