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


def test_top_k_alone_keeps_the_k_most_likely_and_follows_their_distribution():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.05, 0.3, 0.1] + [1e-6] * (VOCAB - 5)]))
    batch = _batch([SamplingParams(temperature=1.0, top_k=2)] * 4000)
    assert batch.needs_top_k and not batch.needs_top_p  # the sort-free path
    counts = torch.bincount(sample(logits.expand(4000, -1).contiguous(), batch), minlength=VOCAB)
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 3}
    assert abs(counts[1].item() / 4000 - 0.5 / 0.8) < 0.04


def test_rows_mix_filters_without_a_sort_and_never_draw_a_masked_token():
    logits = torch.full((3, VOCAB), -30.0)
    logits[:, 0], logits[:, 1], logits[:, 2] = 4.0, 3.0, 2.0
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, min_p=0.2),
              SamplingParams(temperature=2.0)]
    for seed in range(60):
        batch = _batch(params, [seed, seed + 1000, seed + 2000])
        assert not batch.needs_top_p
        drawn = sample(logits, batch).tolist()
        assert drawn[0] == 0 and drawn[1] in (0, 1) and 0 <= drawn[2] < VOCAB


def test_defaults_skip_every_filter():
    batch = _batch([SamplingParams(temperature=1.0)] * 3)
    assert not (batch.needs_top_k or batch.needs_top_p or batch.needs_min_p)


def test_a_seeded_row_draws_the_same_whether_or_not_the_step_sorts():
    logits = torch.zeros(1, VOCAB)
    logits[0, :6] = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 1.0])  # ties at the k-th value
    mine = SamplingParams(temperature=1.0, top_k=2, seed=3)
    for seed in range(30):
        alone = sample(logits, _batch([mine], [seed]))
        with_top_p = sample(torch.cat([logits, logits]), _batch([mine, SamplingParams(temperature=1.0, top_p=0.5)],
                                                                 [seed, None]))
        assert alone[0] == with_top_p[0] and alone[0] in (0, 1, 2, 3)


def test_top_p_beyond_its_candidates_sorts_the_row_and_keeps_the_right_prefix():
    from kvpilot.model import sampler

    flat = torch.zeros(1, 600)  # uniform: top_p 0.9 keeps 540 tokens, more than the 256 candidates
    params = [SamplingParams(temperature=1.0, top_p=0.9)]
    batch = SamplingBatch.build(params, [None], 600, torch.device("cpu"))
    cutoff = sampler._top_p_cutoff(flat, batch.top_p)
    assert cutoff.item() == 0.0  # ties: every token has the cut-off value, all are kept
    peaked = torch.arange(600, dtype=torch.float32)[None, :] * -0.002  # slowly decreasing: top_p 0.9 needs ~500 tokens
    kept = (peaked >= sampler._top_p_cutoff(peaked, batch.top_p)).sum().item()
    probs = peaked.softmax(-1)[0]
    assert probs[:kept - 1].sum() <= 0.9 < probs[:kept].sum() + 1e-6 and kept > 256


def test_staged_columns_sample_the_same_tokens():
    """The CUDA path sends the four columns as float32 views of one asynchronous copy (top_k widened back on
    the device) and sizes top-k from the host: the same seeded draws as plain copies."""
    import numpy as np

    from kvpilot.model.device_staging import PackedArrays

    columns = (np.array([0.0, 0.7, 1.3, 1.0], dtype=np.float32), np.array([0, 5, 0, 12]),
               np.array([1.0, 0.9, 0.5, 1.0], dtype=np.float32), np.array([0.0, 0.0, 0.05, 0.1], dtype=np.float32))
    draws = []
    for staging in (None, PackedArrays(torch.device("cpu"), dtype=torch.float32)):
        gens = {i: torch.Generator().manual_seed(11 + i) for i in range(4)}
        batch = SamplingBatch.from_columns(*columns, gens, VOCAB, torch.device("cpu"), staging)
        assert batch.max_top_k == VOCAB and batch.top_k.dtype == torch.int64  # rows without top-k keep all
        draws.append(sample(_logits(4, seed=3), batch).tolist())
    assert draws[0] == draws[1]


def test_staged_penalties_match_plain_copies():
    """Penalty rows and columns sent as views of one staged copy (the CUDA path) penalize exactly as plain
    copies: repetition on prompt and output tokens, frequency and presence on output tokens."""
    import numpy as np

    from kvpilot.model.device_staging import PackedArrays
    from kvpilot.model.logits_processors import PenaltyState

    results = []
    for staged in (False, True):
        state = PenaltyState(4, VOCAB, torch.device("cpu"))
        if staged:
            state._index_staging = PackedArrays(torch.device("cpu"))
            state._column_staging = PackedArrays(torch.device("cpu"), dtype=torch.float32)
        state.add(1, SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), [3, 7, 7], [9])
        state.add(3, SamplingParams(presence_penalty=0.8), [1], [])
        state.add(2, SamplingParams(), [4], [])
        rows = np.array([2, 1, 3])
        state.record(rows, torch.tensor([5, 9, 11]))
        results.append(state.apply(_logits(3, seed=6), rows))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    assert not torch.equal(results[0], _logits(3, seed=6))  # the penalties did change the logits


def test_top_k_0_is_off_like_minus_1() -> None:
    """vLLM (since 0.9) and HF generation configs turn top-k off with 0: the same draws as -1, seed for seed."""
    logits = _logits(1, seed=3)
    off = [int(sample(logits, _batch([SamplingParams(temperature=1.0, top_k=-1)], [s]))[0]) for s in range(20)]
    zero = [int(sample(logits, _batch([SamplingParams(temperature=1.0, top_k=0)], [s]))[0]) for s in range(20)]
    assert zero == off and len(set(off)) > 1  # sampled, not collapsed to the argmax
    assert not _batch([SamplingParams(temperature=1.0, top_k=0)]).needs_top_k
