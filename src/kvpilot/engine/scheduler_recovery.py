"""The scheduler's side of recovering from a failed step (engine/step_failures.py decides who is at fault):
roll the failed steps' requests back, and schedule one suspect alone while it is probed. A mixin of Scheduler,
kept apart so scheduler.py stays about normal scheduling; it uses the Scheduler's state directly."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.step_builder import StepBuilder

if TYPE_CHECKING:
    from kvpilot.engine.scheduler import Scheduler

    _Base = Scheduler
else:
    _Base = object


class SchedulerRecovery(_Base):
    """Invariant: while `_isolated_id` names an unfinished request, schedule() computes only that request."""

    def roll_back(self, request_ids: Iterable[str]) -> None:
        """The steps that scheduled these requests failed, so the tokens they had in flight will never come:
        each unfinished one is preempted (blocks freed; its known tokens are recomputed when it is admitted
        again) and keeps no token in flight. The caller tells the runner to drop their rows."""
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self._preempt(request)
            request.num_output_placeholders = 0

    def isolate(self, request_id: str | None) -> None:
        """While set (to an unfinished request), each step schedules that request alone: others keep their
        state (running ones their blocks, unless preempted to make room) but compute nothing and nothing is
        admitted. The engine probes a suspect of a failed step this way. None: back to normal."""
        self._isolated_id = request_id

    def _schedule_alone(self, step: StepBuilder, request: Request) -> list[Request]:
        """Only `request` computes: its next chunk if it runs; if it waits, it is admitted, preempting the
        newest running requests while it lacks blocks or a max_num_seqs slot."""
        if request.status is RequestStatus.RUNNING:
            return self._schedule_running(step, only=request)
        preempted: list[Request] = []
        if request.num_output_placeholders:
            return preempted  # its last token is still being sampled: admit it once that is known
        while True:
            hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - hit.num_tokens, step.budget)
            if len(self._running) < self.config.max_num_seqs and \
                    self.kv.allocate_slots(request, num_new, hit) is not None:
                break
            if not self._running:
                return preempted  # cannot happen for a request that fits the cache (check_request_fits)
            victim = self._running[-1]
            self._preempt(victim)
            preempted.append(victim)
        self._waiting.remove(request)
        self._admit(request, hit.num_tokens)
        step.add(request, self._chunk(request, num_new), 0, admitted=True)
        return preempted
