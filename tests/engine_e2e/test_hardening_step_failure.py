"""Issue 14, part A: a step that raises because of one request fails that request alone; the engine keeps
serving the others, with the tokens they produce alone, its invariants intact and no block leaked.

The failure is real, not mocked: SamplingParams is range-checked when built, so a value it would refuse can
only reach the runner by being set afterwards (as a careless LLM user might); the runner then raises inside
the step (OverflowError writing top_k into its persistent batch) for that request only."""

from __future__ import annotations

import pytest

from kvpilot import LLM, SamplingParams
from kvpilot.sampling_params import SamplingParamsError
from tests.engine_e2e.conftest import assert_no_leak, run_alone

NUM_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


def _poisoned() -> SamplingParams:
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    params.top_k = 10**20  # past validation: only the runner sees it
    return params


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, llm_fp32) -> LLM:
    return LLM(loaded=llm_fp32.loaded, kv_cache_memory="256MiB", max_model_len=2048,
               async_scheduling=request.param)


@pytest.fixture(scope="module")
def prompts(mixed_prompts) -> list[list[int]]:
    return mixed_prompts[:8]


@pytest.fixture(scope="module")
def alone(reference_llm, prompts) -> list[list[int]]:
    return run_alone(reference_llm, prompts, GREEDY)


def test_one_failing_request_fails_alone_and_seven_finish_as_alone(llm, prompts, alone) -> None:
    culprit = 3
    params = [_poisoned() if i == culprit else GREEDY for i in range(len(prompts))]
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.scheduler.check_integrity()  # after every step, the failed ones included
    failed = finals[ids[culprit]]
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert "failed when run alone" in failed.error and "OverflowError" in failed.error
    for i, rid in enumerate(ids):
        if i != culprit:
            assert finals[rid].outputs[0].finish_reason == "length" and finals[rid].error is None
            assert finals[rid].outputs[0].token_ids == alone[i], f"request {i} differs from its run alone"
    assert_no_leak(llm)
    after = llm.generate([prompts[1]], GREEDY)[0]  # the engine still serves
    assert after.outputs[0].token_ids == alone[1]
    assert_no_leak(llm)


def test_a_failure_while_requests_decode_keeps_their_progress(llm, prompts, alone) -> None:
    """The culprit arrives while 7 requests are mid-decode: they are rolled back, recomputed, and still
    produce exactly their tokens alone."""
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts[:7]]
    for _ in range(4):
        engine.step()
    bad = engine.add_request(prompts[7], _poisoned())
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.scheduler.check_integrity()
    assert finals[bad].outputs[0].finish_reason == "error"
    assert [finals[rid].outputs[0].token_ids for rid in ids] == alone[:7]
    assert_no_leak(llm)


def test_llm_users_get_a_clear_exception_for_bad_values(llm_fp32) -> None:
    with pytest.raises(SamplingParamsError, match="top_k must be 0 or -1"):
        SamplingParams(top_k=10**20)
    with pytest.raises(SamplingParamsError, match="seed must be in 0..2\\*\\*64-1"):
        SamplingParams(seed=-1)
    with pytest.raises(SamplingParamsError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-320)
    with pytest.raises(SamplingParamsError, match="stop_token_ids .* outside the vocabulary"):
        llm_fp32.generate([[1, 2, 3]], SamplingParams(min_tokens=1, stop_token_ids=[999999]))
    assert_no_leak(llm_fp32)  # refused before anything was queued
