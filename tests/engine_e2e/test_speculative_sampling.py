"""Sampled output with speculation has the target's distribution (a chi-square test): a dummy model with an
8-token vocabulary, thousands of unseeded requests whose second and third tokens come from verifications
(drafts accepted or rejected), against the exact distribution computed from the model's own logprobs."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.model.loader import load_model

VOCAB = 8
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "tie_word_embeddings": True,
        "bos_token_id": 0, "eos_token_id": VOCAB - 1}
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # n-gram drafts for every continuation
TEMPERATURE = 0.25  # the dummy's logits are small: sharpen them so drafts are often right, often wrong
NUM_SAMPLES = 2000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps({**get_hf_config("smollm2-135m"), **TINY}))
    return load_model(str(path), load_format="dummy", dtype="float32", device="cpu", max_model_len=64)


def _next_token_probs(llm: LLM, prefixes: list[list[int]]) -> list[list[float]]:
    """The target's next-token distribution after each prefix, at TEMPERATURE."""
    outputs = llm.generate([PROMPT + p for p in prefixes],
                           SamplingParams(temperature=1.0, max_tokens=1, logprobs=VOCAB, ignore_eos=True))
    probs = []
    for output in outputs:
        scaled = dict((t, lp / TEMPERATURE) for t, lp in output.outputs[0].logprobs[0].top_logprobs)
        total = math.log(sum(math.exp(v) for v in scaled.values()))
        probs.append([math.exp(scaled[t] - total) for t in range(VOCAB)])
    return probs


def _chi_square_passes(observed: Counter, expected: dict, num: int, p_value: float = 1e-4) -> bool:
    """Pearson's test, cells of expected count < 5 pooled; Wilson-Hilferty's quantile of the chi-square law."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for key, prob in expected.items():
        if prob * num < 5:
            pooled_obs, pooled_exp = pooled_obs + observed[key], pooled_exp + prob * num
            continue
        stat, cells = stat + (observed[key] - prob * num) ** 2 / (prob * num), cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    df = cells - 1
    z = {1e-4: 3.719, 1e-3: 3.090}[p_value]
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


def test_sampled_speculation_keeps_the_target_distribution(tiny):
    plain = LLM(loaded=tiny, kv_cache_memory="16MiB", max_model_len=64)
    first = _next_token_probs(plain, [[]])[0]
    second = _next_token_probs(plain, [[a] for a in range(VOCAB)])
    third = _next_token_probs(plain, [[a, b] for a, b in itertools.product(range(VOCAB), repeat=2)])
    pair = {(a, b): first[a] * second[a][b] for a, b in itertools.product(range(VOCAB), repeat=2)}
    marginal3 = {c: sum(pair[a, b] * third[VOCAB * a + b][c] for a, b in pair) for c in range(VOCAB)}

    spec = LLM(loaded=tiny, kv_cache_memory="16MiB", max_model_len=64,
               speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3})
    spec.engine.scheduler.speculator.step_price = lambda num_running: 0.0  # every decode verifies drafts
    torch.manual_seed(0)
    outputs = spec.generate([PROMPT] * NUM_SAMPLES, SamplingParams(temperature=TEMPERATURE, max_tokens=3,
                                                                   ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in outputs]
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    assert drafted > NUM_SAMPLES // 3 and 0.1 * drafted < accepted < 0.9 * drafted  # both verdicts, often
    assert _chi_square_passes(Counter((t[0], t[1]) for t in tokens), pair, NUM_SAMPLES)
    assert _chi_square_passes(Counter(t[2] for t in tokens), marginal3, NUM_SAMPLES)


def test_a_wrong_distribution_fails_the_same_test(tiny):
    """The test has power at this sample size: 5% of the probability moved between the two likeliest tokens
    (smaller than a wrong resampling rule's error) fails it."""
    plain = LLM(loaded=tiny, kv_cache_memory="16MiB", max_model_len=64)
    first = dict(enumerate(_next_token_probs(plain, [[]])[0]))
    top, second = sorted(first, key=first.get, reverse=True)[:2]
    wrong = {**first, top: first[top] + 0.05, second: first[second] - 0.05}
    counts = Counter({t: round(NUM_SAMPLES * p) for t, p in wrong.items()})
    assert not _chi_square_passes(counts, first, sum(counts.values()))
    assert _chi_square_passes(Counter({t: round(NUM_SAMPLES * p) for t, p in first.items()}), first, NUM_SAMPLES)
