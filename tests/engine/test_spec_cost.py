"""The speculation cost model as pure functions: a draft pays when alpha**j beats the price of its row, the
price follows the fitted step time, and large batches (or no acceptance) switch speculation off."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine.ngram_proposer import NgramProposer
from kvpilot.engine.spec_acceptance import AcceptanceTracker
from kvpilot.engine.spec_config import SpeculativeConfig
from kvpilot.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from kvpilot.engine.spec_cost import (PRICE_CUTOFF, PRIOR_ROW_FRACTION, DraftCost, StepTimeModel, draft_model_price,
                                      draft_price, expected_tokens, num_worthwhile_drafts)
from kvpilot.engine.speculator import Speculator, speculation_eligible
from kvpilot.sampling_params import SamplingParams


def test_drafts_pay_while_their_acceptance_beats_the_price():
    assert num_worthwhile_drafts(0.9, 0.05, 4) == 4  # copying text at one stream: every draft pays
    assert num_worthwhile_drafts(0.8, 0.5, 4) == 3  # 0.8, 0.64, 0.512 > 0.5 > 0.41
    assert num_worthwhile_drafts(0.3, 0.5, 4) == 0  # fresh text on a busy step: none
    assert num_worthwhile_drafts(0.99, 0.0, 2) == 2  # capped by num_speculative_tokens
    assert num_worthwhile_drafts(0.0, 0.0, 4) == 0  # never accepted: never drafted


def test_expected_tokens_of_a_verification():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5


def test_the_price_of_a_row_grows_with_the_batch():
    # weights read once a step (10 ms), each row 0.2 ms: one stream pays 2% a row, 64 streams 56%
    assert draft_price(0.010, 0.0002, 1) == pytest.approx(0.0002 / 0.0102)
    assert draft_price(0.010, 0.0002, 64) == pytest.approx(0.0128 / 0.0228)
    assert draft_price(0.010, 0.0, 64) == 0.0
    assert draft_price(-0.001, 0.0002, 1) == 1.0  # a degenerate fit: off


def test_the_step_time_fit_recovers_fixed_and_per_row_costs():
    model = StepTimeModel()
    rng = random.Random(3)
    for _ in range(300):  # one stream: plain decodes (1 row) and verifications (2..5 rows), a little noise
        rows = rng.choice([1, 1, 2, 5])
        model.observe(rows, 0.004 + 0.0003 * rows + rng.gauss(0, 0.00002))
    fixed, per_row = model.fit(1)
    assert fixed == pytest.approx(0.004, rel=0.05) and per_row == pytest.approx(0.0003, rel=0.1)


def test_steps_of_one_size_leave_the_prior_proportions():
    """64 rows every step cannot tell fixed from per-row costs: the prior (a row = 1/8 of the fixed cost)
    decides, pricing a row at 8/9 of a token: speculation stays off for any realistic acceptance."""
    model = StepTimeModel()
    for _ in range(50):
        model.observe(64, 0.050)
    fixed, per_row = model.fit(64)
    assert per_row / fixed == pytest.approx(PRIOR_ROW_FRACTION)
    assert fixed + 64 * per_row == pytest.approx(0.050)
    assert num_worthwhile_drafts(0.8, model.price(64), 4) == 0


def test_a_compute_bound_batch_switches_speculation_off():
    """Rows that cost a third of the weights read (a CPU at 64 streams): even 90% acceptance does not pay;
    at one stream the same device speculates fully."""
    model = StepTimeModel()
    for rows in [60, 61, 62, 63, 64, 66, 68] * 20:
        model.observe(rows, 0.003 + 0.001 * rows)
    assert model.price(64) > 0.93 and num_worthwhile_drafts(0.9, model.price(64), 4) == 0
    assert num_worthwhile_drafts(0.9, model.price(1), 4) == 4


def test_each_batch_size_is_priced_by_steps_near_it():
    """One stream's rows are nearly free (memory-bound), 64 streams' cost 3 ms each (compute-bound): a single
    line through all steps would price a row at 64 streams far too cheap and speculate there."""
    model = StepTimeModel()
    for _ in range(100):
        for rows in (1, 1, 3, 5):
            model.observe(rows, 0.005 + 0.0002 * rows)
        for rows in (60, 64, 66):
            model.observe(rows, 0.003 * rows)
    assert model.price(1) < 0.06 and num_worthwhile_drafts(0.7, model.price(1), 4) == 4
    assert model.price(64) > 0.95 and num_worthwhile_drafts(0.9, model.price(64), 4) == 0


def test_acceptance_estimates():
    tracker = AcceptanceTracker()
    assert tracker.alpha("a") == 0.5  # nothing verified: the engine's prior
    for _ in range(20):
        tracker.record("a", 4, 4)  # copies: all accepted
        tracker.record("b", 4, 0)  # fresh text: the first draft rejected
    assert tracker.alpha("a") > 0.9 and tracker.alpha("b") < 0.2
    assert 0.4 < tracker.alpha("c") < 0.9  # a new request starts from the engine's estimate
    low = tracker.alpha("b")
    for _ in range(60):
        tracker.passed_over("b")  # not tried for a while: drifts back towards the engine's estimate
    assert tracker.alpha("b") > low + 0.3
    tracker.forget("a")
    assert tracker.alpha("a") == tracker.engine_alpha


def test_the_speculator_prices_a_step_and_skips_requests_that_cannot_be_verified_exactly():
    speculator = Speculator(SpeculativeConfig(disable_by_batch_size=32), NgramProposer(1, 3))
    assert speculator.step_price(1) == pytest.approx(PRIOR_ROW_FRACTION / (1 + PRIOR_ROW_FRACTION))
    assert speculator.step_price(32) is None  # disable_by_batch_size
    for rows in [8, 12, 16, 24] * 30:  # each row as costly as the weights read: priced out from a few rows
        speculator.step_times.observe(rows, 0.001 + 0.001 * rows)
    assert speculator.step_price(1) is not None and speculator.step_price(16) is None
    assert speculation_eligible(SamplingParams(temperature=0.7, top_p=0.9, seed=3), 0)
    assert speculation_eligible(SamplingParams(temperature=0, logit_bias={5: 1.0}), 0)
    for params, num_output in [(SamplingParams(presence_penalty=0.5), 3), (SamplingParams(logprobs=2), 3),
                               (SamplingParams(min_tokens=5), 4)]:
        assert not speculation_eligible(params, num_output)
    assert speculation_eligible(SamplingParams(min_tokens=5), 5)


def test_a_draft_models_rounds_are_priced_in_tokens_of_plain_decoding():
    assert draft_model_price(0.010, 0.0, 1, 0.0) == 0.0  # one stream, weight-bound: a verify row is free
    assert draft_model_price(0.010, 0.0, 1, 0.001) == pytest.approx(0.1)  # a draft 10x cheaper than a step
    assert draft_model_price(0.010, 0.0, 1, 0.010) == pytest.approx(1.0)  # as costly as the target: never pays
    assert draft_model_price(0.010, 0.001, 4, 0.001) == pytest.approx(draft_price(0.010, 0.001, 4) + 4 * 0.001 / 0.014)
    cost = DraftCost()
    cost.observe(0.0, 4, 1)  # n-gram: no draft work
    assert cost.round_share == 0.0
    cost.observe(0.008, 4, 2)  # 4 rounds over 2 requests: 1 ms each
    assert cost.round_share == pytest.approx(0.001)
    for _ in range(50):
        cost.observe(0.024, 4, 2)  # the draft got slower: 3 ms each, learned within tens of steps
    assert cost.round_share == pytest.approx(0.003, rel=0.01)


def _verify_step(num_drafts: int) -> SchedulerOutput:
    return SchedulerOutput(chunks=[ScheduledChunk("a", 10, 1 + num_drafts, True)],
                           draft_token_ids={"a": [5] * num_drafts})


def test_a_draft_as_costly_as_the_target_switches_speculation_off():
    speculator = Speculator(SpeculativeConfig(), NgramProposer(1, 3))
    for _ in range(40):  # one stream: a 10 ms verify step plus 4 draft rounds of 10 ms each
        speculator.observe_step(_verify_step(4), 0.050, draft_seconds=0.040)
    fixed, per_row = speculator.step_times.fit(5)
    assert fixed + 5 * per_row == pytest.approx(0.010, rel=0.05)  # the target's time alone: t(1 + 4 rows)
    assert speculator.step_price(1) is None  # priced >= PRICE_CUTOFF: no drafts
    cheap = Speculator(SpeculativeConfig(), NgramProposer(1, 3))
    for _ in range(40):  # a draft model 10x cheaper than the target
        cheap.observe_step(_verify_step(4), 0.014, draft_seconds=0.004)
    fixed, per_row = cheap.step_times.fit(1)
    round_share = 0.004 / 4  # each of 4 rounds: 1 ms for its one request
    assert cheap.step_price(1) == pytest.approx(draft_price(fixed, per_row, 1) + round_share / (fixed + per_row))
    assert cheap.step_price(1) < PRICE_CUTOFF  # drafts that are accepted often still pay
