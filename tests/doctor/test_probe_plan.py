"""Sizing of the live probes (`kvpilot doctor --url`): every phase fits the server's context, never
exceeds the ramp's top concurrency or the phase deadline, sends whole rounds of its concurrency, and scales with
the measured baseline."""

from __future__ import annotations

import pytest

from kvpilot.doctor.probe import PhaseResult, thin_phases
from kvpilot.doctor.probe_plan import (DEFAULT_MAX_MODEL_LEN, FULL, QUICK, TOKEN_SLACK, Baseline, ProbeLimits,
                                       RampPoint, knee_reason,
                                       ProbePhase, baseline_phase, plan_after_baseline)
from kvpilot.doctor.thresholds import Thresholds

BASELINES = {  # batch-1 TTFT (ms), TPOT (ms), prompt tokens, as a baseline phase would measure them
    "gpu": Baseline(ttft_ms=15.0, tpot_ms=5.0, num_prompt_tokens=128),
    "cpu": Baseline(ttft_ms=400.0, tpot_ms=100.0, num_prompt_tokens=64),
    "starved cpu": Baseline(ttft_ms=3000.0, tpot_ms=600.0, num_prompt_tokens=64),
}


def _longest(phase: ProbePhase) -> int:
    d = phase.dataset
    return max(d.input_len, d.long_input_len if d.kind == "long-short" else 0)


@pytest.mark.parametrize("limits", [FULL, QUICK], ids=lambda x: x.name)
@pytest.mark.parametrize("max_model_len", [128, 1024, 8192, None])
@pytest.mark.parametrize("base", BASELINES.values(), ids=BASELINES.keys())
def test_every_phase_fits_and_is_bounded(limits: ProbeLimits, max_model_len: int | None, base: Baseline) -> None:
    phases = [baseline_phase(limits, max_model_len), *plan_after_baseline(limits, max_model_len, base)]
    context = max_model_len or DEFAULT_MAX_MODEL_LEN
    for phase in phases:
        assert _longest(phase) * TOKEN_SLACK + phase.dataset.output_len <= context, phase.describe()
        assert 1 <= (phase.load.concurrency or 0) <= limits.max_in_flight
        assert phase.load.duration_s is not None and phase.load.duration_s <= limits.phase_s
        assert 1 <= (phase.load.num_requests or 0) <= limits.max_requests
        assert phase.load.num_requests % phase.load.concurrency == 0, phase.describe()  # whole rounds
    kinds = [p.dataset.kind for p in phases]
    assert kinds.count("long-short") == 1 and kinds.count("shared-prefix") == 1
    ramp = [p.load.concurrency for p in phases if p.name.startswith("ramp") or p.name == "baseline"]
    assert tuple(ramp) == limits.ramp  # the baseline is the ramp's first point


@pytest.mark.parametrize("limits", [FULL, QUICK], ids=lambda x: x.name)
def test_long_prompts_are_long_and_a_fast_server_gets_more_requests(limits: ProbeLimits) -> None:
    fast = plan_after_baseline(limits, 8192, BASELINES["gpu"])
    slow = plan_after_baseline(limits, 8192, BASELINES["starved cpu"])
    for f, s in zip(fast, slow, strict=True):
        assert (f.load.num_requests or 0) >= (s.load.num_requests or 0)
        assert (f.load.duration_s or 0) >= (s.load.duration_s or 0)  # a slow server stops sending sooner
    mixed = next(p.dataset for p in fast if p.dataset.kind == "long-short")
    assert mixed.long_input_len >= 4 * mixed.input_len and mixed.long_input_len == limits.max_long_len
    # on the starved CPU the long prompt is cut to what prefills within the budget, still 4x a short one
    starved = next(p.dataset for p in slow if p.dataset.kind == "long-short")
    assert 4 * starved.input_len <= starved.long_input_len < limits.max_long_len


def test_quick_probe_is_smaller_than_the_full_one() -> None:
    assert QUICK.max_in_flight < FULL.max_in_flight and QUICK.phase_s < FULL.phase_s
    assert not QUICK.unique_control and FULL.unique_control
    names = [p.name for p in plan_after_baseline(FULL, None, BASELINES["cpu"])]
    assert names == ["long-short", "shared-prefix", "unique-prefix", "ramp-2", "ramp-4", "ramp-8", "ramp-16",
                     "ramp-32", "ramp-64"]
    assert FULL.find_knee and not QUICK.find_knee


def test_ramp_stops_at_the_knee_or_on_failures() -> None:
    rising = [RampPoint(1, 50.0), RampPoint(2, 95.0), RampPoint(4, 170.0)]
    assert knee_reason(rising[:1]) is None and knee_reason(rising) is None
    flat = [*rising, RampPoint(8, 180.0)]
    assert knee_reason(flat) == "throughput stopped rising: 180.0 tok/s at 8 in flight, +6% over 4"
    assert knee_reason([*rising, RampPoint(8, 400.0, failed_share=0.25)]) == "25% of the requests at 8 in flight failed"


def test_max_concurrency_cuts_the_ramp_and_a_fixed_ramp_repeats_points() -> None:
    assert FULL.capped(10).ramp == (1, 2, 4, 8, 10) and FULL.capped(10).max_in_flight == 10
    assert FULL.capped(1).ramp == (1,) and FULL.capped(1).mixed_concurrency == 1
    assert FULL.capped(500).ramp == FULL.ramp
    again = FULL.fixed_ramp((1, 2, 4))
    assert again.ramp == (1, 2, 4) and not again.find_knee


def test_baseline_request_time_estimate() -> None:
    base = BASELINES["cpu"]  # 400 ms for 64 tokens: 6.25 ms per prompt token, 100 ms per output token
    assert base.request_s(128, 16) == pytest.approx((128 * 6.25 + 15 * 100) / 1000)


@pytest.mark.parametrize("limits", [FULL, QUICK], ids=lambda x: x.name)
def test_baseline_has_enough_requests_to_be_compared(limits: ProbeLimits) -> None:
    """Rules comparing loads (TPOT growth, flat throughput) skip runs under min_requests."""
    assert limits.num_baseline >= Thresholds().min_requests


def test_phases_the_deadline_left_thin_are_noted() -> None:
    phase = baseline_phase(QUICK, 1024)
    results = [PhaseResult(phase, {}, 4.0, num_ok, num_ok, None) for num_ok in (5, 1)]
    assert thin_phases(results[:1], 5) == ()
    (note,) = thin_phases(results, 5)
    assert "'baseline' (1)" in note and "fewer than 5" in note
