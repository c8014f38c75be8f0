"""The executor seam: what the engine loop needs from whatever runs the model (the runner in this process,
or the tensor-parallel ranks' worker processes, launch/tp.py). It sees only the scheduler's diffs and returns
RunnerOutputs."""

from __future__ import annotations

from typing import Protocol

from kvpilot.engine.scheduler_output import RunnerOutput, SchedulerOutput


class StepHandle(Protocol):
    """A launched step; result() blocks until its sampled tokens are on the host (once; then cached)."""

    def result(self) -> RunnerOutput: ...


class Executor(Protocol):
    """Invariant: execute_model is called once per SchedulerOutput, in order, and the handles' results are
    read in the same order; a step may be launched before the previous step's result is read (async
    scheduling), never two ahead."""

    def execute_model(self, output: SchedulerOutput) -> StepHandle: ...
