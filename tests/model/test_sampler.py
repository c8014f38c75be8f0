"""Batched sampler: greedy, filters, and per-request seeds independent of the rest of the batch."""

from __future__ import annotations

import torch

from kvpilot.model.sampler import SamplingBatch, sample
from kvpilot.sampling_params import SamplingParams

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _batch(params, seeds=None):
    gens = [torch.Generator().manual_seed(s) if s is not None else None for s in (seeds or [None] * len(params))]
    return SamplingBatch.build(params, gens, VOCAB, torch.device("cpu"))


def test_greedy_and_top_k_1_take_the_argmax():
    logits = _logits(4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)] * 2
    assert sample(logits, _batch(params)).tolist() == logits.argmax(-1).tolist()


def test_seeded_row_does_not_depend_on_the_batch():
    logits = _logits(1, seed=5)
    alone = sample(logits, _batch([SamplingParams(temperature=1.0, seed=7)], [7]))
    mixed_logits = torch.cat([_logits(3, seed=9), logits])
    params = [SamplingParams(temperature=0.5)] * 3 + [SamplingParams(temperature=1.0, seed=7)]
    mixed = sample(mixed_logits, _batch(params, [None, None, None, 7]))
    assert mixed[3] == alone[0]


def test_top_p_and_min_p_keep_only_likely_tokens():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 3], logits[0, 8] = 5.0, 4.0  # two likely tokens, the rest negligible
    for params in (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, min_p=0.1)):
        draws = {int(sample(logits, _batch([params], [s]))[0]) for s in range(40)}
        assert draws == {3, 8}


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (VOCAB - 3)]))
    batch = _batch([SamplingParams(temperature=1.0)] * 4000)
    counts = torch.bincount(sample(logits.expand(4000, -1).contiguous(), batch), minlength=VOCAB)
    assert abs(counts[0].item() / 4000 - 0.7) < 0.04 and abs(counts[1].item() / 4000 - 0.2) < 0.04
