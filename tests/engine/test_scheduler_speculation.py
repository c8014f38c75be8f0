"""Speculative decoding in the scheduler, over the paged fake model that verifies drafts (spec_fakes.py):
outputs are those of each prompt run alone whatever is accepted or rejected, under batching, chunked
prefill, prefix caching, preemption and a sliding window; drafts respect the budget, max_tokens and the
free blocks; rejected drafts are rolled back (computed tokens, freed blocks, the runner told)."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine.config import cdiv
from kvpilot.engine.ngram_proposer import NgramProposer
from tests.engine.engine_fakes import VOCAB_OFFSET, generate_alone, make_request, make_scheduler
from tests.engine.spec_fakes import FakeVerifyingModel, OracleProposer, always_speculate, run_verifying


def _workload(rng: random.Random, num_requests: int, shared: list[int]) -> list[tuple[list[int], int]]:
    prompts = []
    for _ in range(num_requests):
        own = [VOCAB_OFFSET + rng.randrange(64) for _ in range(rng.randrange(1, 30))]
        prompts.append(((shared if rng.random() < 0.5 else []) + own, rng.randrange(1, 25)))
    return prompts


@pytest.mark.parametrize("num_blocks, budget, window, prefix, preempts", [
    (200, 64, None, True, False),  # plain batching and prefix hits
    (200, 9, None, True, False),  # chunked prefill; drafts squeezed by the budget
    (40, 64, None, True, True),  # preemption
    (40, 16, None, False, False),
    (60, 32, 8, True, False),  # sliding window: blocks released ahead of the drafts
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_equal_each_prompt_alone(num_blocks, budget, window, prefix, preempts, seed):
    rng = random.Random(seed)
    scheduler = make_scheduler(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget,
                               max_num_seqs=min(8, budget // 2), max_model_len=160, enable_prefix_caching=prefix,
                               sliding_window=window)
    proposer = OracleProposer(0.7, seed, window)
    speculator = always_speculate(scheduler, proposer)
    model = FakeVerifyingModel(4, scheduler.kv.pool, window)
    work = _workload(rng, 14, [VOCAB_OFFSET + i for i in range(13)])
    for i, (prompt, max_tokens) in enumerate(work):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens))
    run = run_verifying(scheduler, model)
    for i, (prompt, max_tokens) in enumerate(work):
        assert run.tokens[f"r{i}"] == generate_alone(prompt, max_tokens, window), f"r{i}"
    assert all(reason == "length" for reason in run.finish_reasons.values())
    drafts = [d for o in run.outputs for d in o.draft_token_ids.values()]
    assert drafts and max(map(len, drafts)) <= 4
    assert any(o.trimmed_tables for o in run.outputs)  # some rejections freed a block
    assert all(o.num_batched_tokens <= budget for o in run.outputs)
    assert (scheduler.num_preemptions > 0) == preempts
    assert (scheduler.kv.prefix_stats.num_hits > 0) == prefix
    assert scheduler.kv.pool.counts().num_used == 0 and proposer.forgotten == {f"r{i}" for i in range(len(work))}
    assert not speculator.acceptance._requests


def test_the_ngram_proposer_end_to_end():
    """Fake tokens repeat (64 values), so 1-gram matches abound and are mostly wrong: many rejections."""
    scheduler = make_scheduler(block_size=4, num_blocks=100, max_model_len=200)
    always_speculate(scheduler, NgramProposer(1, 3), num_drafts=3)
    prompts = [[VOCAB_OFFSET + (7 * i + j) % 9 for j in range(20 + i)] for i in range(5)]
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt, 30))
    run = run_verifying(scheduler, FakeVerifyingModel(4, scheduler.kv.pool))
    for i, prompt in enumerate(prompts):
        assert run.tokens[f"r{i}"] == generate_alone(prompt, 30)
    assert sum(map(len, (d for o in run.outputs for d in o.draft_token_ids.values()))) > 50


@pytest.mark.parametrize("runner_seconds", [0.0, 0.25])
def test_each_request_is_charged_the_time_its_drafts_took(runner_seconds):
    """n-grams: the proposer's own time in the scheduler; a draft model: its steps in the runner, each charged
    whole to every request it drafted for. The request's metrics carry the sum (the response's draft_ms)."""
    scheduler = make_scheduler(block_size=4, num_blocks=100, max_model_len=200)
    always_speculate(scheduler, NgramProposer(1, 3), num_drafts=3)
    requests = [make_request(f"r{i}", [VOCAB_OFFSET + (7 * i + j) % 9 for j in range(20)], 12) for i in range(2)]
    for request in requests:
        scheduler.add_request(request)
    run_verifying(scheduler, FakeVerifyingModel(4, scheduler.kv.pool), draft_seconds=runner_seconds)
    for request in requests:
        assert request.num_drafts > 0 and request.draft_time > runner_seconds * request.num_drafts
        assert request.metrics().draft_time == request.draft_time
        assert request.draft_time < runner_seconds * request.num_drafts + 1.0  # n-gram lookups: microseconds


def test_rejected_drafts_roll_back_and_tell_the_runner():
    scheduler = make_scheduler(block_size=4, num_blocks=50, max_model_len=100)
    always_speculate(scheduler, OracleProposer(0.0), num_drafts=7)  # every first draft rejected
    request = make_request("a", [VOCAB_OFFSET + 1] * 5, max_tokens=20)
    scheduler.add_request(request)
    model = FakeVerifyingModel(4, scheduler.kv.pool)
    output = scheduler.schedule()  # the prompt
    scheduler.update_from_output(output, model.run_verifying(output)[0])
    output = scheduler.schedule()
    assert output.draft_token_ids["a"] and output.chunks[0].num_tokens == 8  # tokens 5..12: 4 blocks
    assert len(request.block_ids) == 4
    sampled, verified = model.run_verifying(output)
    assert len(verified["a"]) == 1  # the target's own token only
    scheduler.update_from_output(output, sampled, verified)
    assert request.num_computed_tokens == request.num_tokens - 1 == 6
    assert len(request.block_ids) == cdiv(request.num_tokens, 4) == 2  # blocks past the known tokens freed
    assert request.num_drafts == 1 and request.num_draft_tokens == 7 and request.num_accepted_tokens == 0
    assert scheduler.schedule().trimmed_tables == {"a": 2}


def test_drafts_never_preempt_and_fit_the_budget():
    """With the cache nearly full a decode falls back to one token rather than preempting for its drafts."""
    scheduler = make_scheduler(block_size=4, num_blocks=5, max_num_batched_tokens=64, max_model_len=20)
    always_speculate(scheduler, OracleProposer(1.0))
    scheduler.add_request(make_request("a", [VOCAB_OFFSET] * 14, max_tokens=6))
    scheduler.add_request(make_request("b", [VOCAB_OFFSET + 1] * 3, max_tokens=2))
    run = run_verifying(scheduler, FakeVerifyingModel(4, scheduler.kv.pool))
    assert scheduler.num_preemptions == 0
    assert run.tokens["a"] == generate_alone([VOCAB_OFFSET] * 14, 6)
    # max_tokens leaves room for at most (max_tokens - outputs - 1) drafts: never a token past max_tokens
    assert all(len(run.tokens[r]) == n for r, n in (("a", 6), ("b", 2)))


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    prompt = [VOCAB_OFFSET + 3] * 6
    alone = generate_alone(prompt, 30)
    eos = alone[9]  # the 10th token: reached in the middle of a verification
    stop_at = alone.index(eos) + 1
    for speculate in (False, True):
        scheduler = make_scheduler(block_size=4, num_blocks=60, max_model_len=100, eos_token_id=eos)
        if speculate:
            always_speculate(scheduler, OracleProposer(1.0))
        scheduler.add_request(make_request("a", prompt, 30, ignore_eos=False))
        run = run_verifying(scheduler, FakeVerifyingModel(4, scheduler.kv.pool))
        assert run.tokens["a"] == alone[:stop_at] and run.finish_reasons["a"] == "stop"
        assert scheduler.kv.pool.counts().num_used == 0
