"""Issue 14, part A: the engine's recovery from a step that raises, on every path, without torch.

LLMEngine runs here over the paged fake model of tests/engine (it checks every diff the way the real runner
needs it: a request sent as new while the runner still holds it, a stale computed count or a wrong block id
fails the test), behind an executor that raises for one request when the step is launched or when its
result is read, in synchronous and async scheduling. The engine must fail that request alone and give every
other one exactly the tokens it produces alone; invariants hold after every step and no block leaks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest

from kvpilot.engine.engine import LLMEngine
from kvpilot.engine.scheduler_output import RunnerOutput, SchedulerOutput
from kvpilot.outputs import RequestOutput
from kvpilot.sampling_params import SamplingParams
from tests.engine.engine_fakes import VOCAB_OFFSET, VOCAB_SIZE, FakePagedModel, generate_alone, make_scheduler

NUM_NEW = 5
PROMPTS = [[1 + i, 2, 3 + i, 4, 5 + 2 * i][: 2 + i % 4] + [7] * (i % 3) for i in range(8)]
Fails = Callable[[SchedulerOutput, str], bool]  # (step, "launch" | "result") -> raise?


@dataclass
class _Handle:
    tokens: dict[str, int] | None
    error: Exception | None

    def result(self) -> RunnerOutput:
        if self.error is not None:
            raise self.error
        assert self.tokens is not None
        return RunnerOutput(dict(self.tokens))


class FailingExecutor:
    """The executor seam over the fake model; `fails` decides, per step and phase, to raise instead."""

    def __init__(self, model: FakePagedModel, fails: Fails) -> None:
        self.model, self.fails = model, fails

    def execute_model(self, output: SchedulerOutput) -> _Handle:
        if self.fails(output, "launch"):
            raise RuntimeError("injected failure at launch")
        tokens = self.model.run(output)
        return _Handle(None, RuntimeError("injected failure at result")) if self.fails(output, "result") else \
            _Handle(tokens, None)


def _holds(request_id: str, phase: str) -> Fails:
    return lambda step, at: at == phase and any(c.request_id == request_id for c in step.chunks)


def _engine(fails: Fails, async_scheduling: bool, num_blocks: int = 64) -> LLMEngine:
    scheduler = make_scheduler(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=24, max_num_seqs=8)
    executor = FailingExecutor(FakePagedModel(4, scheduler.kv.pool), fails)
    return LLMEngine(scheduler, executor, None, VOCAB_OFFSET + VOCAB_SIZE, async_scheduling=async_scheduling)


def _run(engine: LLMEngine, ids: list[str]) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.scheduler.check_integrity()
    assert set(finals) == set(ids), "every request ends"
    return finals


def _assert_idle(engine: LLMEngine) -> None:
    engine.scheduler.check_integrity()
    stats = engine.scheduler.make_stats()
    assert stats.num_running == stats.num_waiting == stats.num_used_blocks == 0


def _add_all(engine: LLMEngine) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    return [engine.add_request(list(p), params, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("phase", ["launch", "result"])
@pytest.mark.parametrize("culprit", ["r0", "r5"])
def test_one_request_that_raises_fails_alone(async_scheduling: bool, phase: str, culprit: str) -> None:
    engine = _engine(_holds(culprit, phase), async_scheduling)
    finals = _run(engine, _add_all(engine))
    for i, prompt in enumerate(PROMPTS):
        out = finals[f"r{i}"]
        if out.request_id == culprit:
            assert out.outputs[0].finish_reason == "error" and "failed when run alone" in (out.error or "")
        else:
            assert out.outputs[0].finish_reason == "length" and out.error is None
            assert out.outputs[0].token_ids == generate_alone(prompt, NUM_NEW)
    _assert_idle(engine)
    after = engine.add_request([9, 9, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert _run(engine, [after])[after].outputs[0].token_ids == generate_alone([9, 9, 9], 3)
    _assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failure_mid_decode_under_kv_pressure(async_scheduling: bool) -> None:
    """The culprit raises only at its third token, while the cache is tight (preemptions happen too)."""
    def fails(step: SchedulerOutput, at: str) -> bool:
        return at == "launch" and any(c.request_id == "r3" and c.needs_sample and c.start_position >= 6
                                      for c in step.chunks)
    engine = _engine(fails, async_scheduling, num_blocks=14)
    finals = _run(engine, _add_all(engine))
    assert finals["r3"].outputs[0].finish_reason == "error" and "failed when run alone" in (finals["r3"].error or "")
    for i, prompt in enumerate(PROMPTS):
        if i != 3:
            assert finals[f"r{i}"].outputs[0].token_ids == generate_alone(prompt, NUM_NEW), i
    assert engine.scheduler.num_preemptions > 0
    _assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_one_off_failure_fails_no_one(async_scheduling: bool) -> None:
    """A fault that is no request's (it happens once, whatever the step holds): everyone is rolled back,
    probed alone, and finishes with its own tokens."""
    failed = []

    def once(step: SchedulerOutput, at: str) -> bool:
        if at == "launch" and step.chunks and len(failed) == 0 and len(step.chunks) > 1:
            failed.append(step)
            return True
        return False
    engine = _engine(once, async_scheduling)
    finals = _run(engine, _add_all(engine))
    assert failed and all(finals[f"r{i}"].outputs[0].token_ids == generate_alone(p, NUM_NEW)
                          for i, p in enumerate(PROMPTS))
    _assert_idle(engine)


def test_a_failure_only_in_batches_ends_within_a_bounded_number_of_strikes() -> None:
    """Every step holding two or more requests raises: probes alone pass, so no request is ever to blame
    alone; each is failed after MAX_STRIKES failed steps or finishes alone. The engine never loops forever."""
    engine = _engine(lambda step, at: at == "launch" and len(step.chunks) > 1, async_scheduling=False)
    finals = _run(engine, _add_all(engine))
    reasons = {o.outputs[0].finish_reason for o in finals.values()}
    assert reasons <= {"error", "length"} and "error" in reasons
    for i, prompt in enumerate(PROMPTS):
        if finals[f"r{i}"].outputs[0].finish_reason == "length":
            assert finals[f"r{i}"].outputs[0].token_ids == generate_alone(prompt, NUM_NEW)
    _assert_idle(engine)
