"""When a step raises: fail the request that caused it, alone, and keep serving the others.

The runner (behind the executor seam) may raise inside a step because of one request's values, or because
of none (a device fault). The exception does not say which request, so the engine finds out:

1. Every request of the failed step(s) is rolled back (Scheduler.roll_back: preempted, its known tokens
   recomputed later, nothing left in flight) and becomes a suspect; each failed step it was in is a strike.
2. Suspects are probed one at a time, each alone in its steps (Scheduler.isolate), until it has sampled
   PROBE_SAMPLES tokens: the probe redoes the work that failed, for that request only, through both the
   prompt path (its recomputation) and the decode path. A suspect that gets through is cleared. Requests the
   failed step admitted are probed first (a step that adds a request to a running batch and fails most
   likely fails because of it).
3. A request is failed (finished with reason "error", blocks freed, RequestOutput.error set) when a failed
   step held it alone (probed or not), or when it reaches MAX_STRIKES (a failure that shows only in a
   batch, caught again and again). A failure found alone explains the failed step: the other suspects of
   that step are cleared without a probe (should one of them be at fault too, it fails again and is
   probed then).

So a failure costs a recomputation of the step's requests, never the engine; the runner drops the rows of
the rolled-back requests, and of those the failed diff finished or preempted (it may not have applied
them), with the next diff. Invariants: every suspect is an unfinished request or is forgotten at the next
step; at most one request is isolated; with no suspects and no rows to drop, this costs nothing per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger("kvpilot.engine")
MAX_STRIKES = 3
PROBE_SAMPLES = 2  # the recomputation's sample, then one decode step
MAX_CAUSE_CHARS = 500  # of the cause's message, as it goes to the client and between processes


class StepFailed(Exception):
    """Raised inside LLMEngine.step when the runner raised for `steps` (launching one, or reading its
    result); `at_launch`: the newest step failed to launch (an older one in flight is still good)."""

    def __init__(self, steps: list[SchedulerOutput], cause: BaseException, at_launch: bool) -> None:
        text = f"{type(cause).__name__}: {cause}"
        super().__init__(text if len(text) <= MAX_CAUSE_CHARS else text[:MAX_CAUSE_CHARS - 3] + "...")
        self.steps, self.cause, self.at_launch = steps, cause, at_launch


@dataclass(frozen=True)
class Verdict:
    """The outcome of one failed step: requests failed for good (request id -> error message), and those
    rolled back to be probed."""

    failed: dict[str, str]
    rolled_back: list[str]


class StepFailures:
    """The engine's record of suspects and of runner rows owed a drop (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, is_live: Callable[[str], bool], max_strikes: int = MAX_STRIKES) -> None:
        self.scheduler, self.is_live, self.max_strikes = scheduler, is_live, max_strikes
        self._strikes: dict[str, int] = {}  # request id -> failed steps it was in (kept while it lives)
        self._suspects: dict[str, int] = {}  # request id -> the failure that made it a suspect; probe order
        self._num_failures = 0
        self._probing: str | None = None
        self._num_probe_samples = 0  # tokens the probed suspect sampled alone so far
        self._drop_finished: list[str] = []
        self._drop_preempted: list[str] = []

    @property
    def num_failures(self) -> int:
        """Failed steps judged so far."""
        return self._num_failures

    @property
    def suspects(self) -> list[str]:
        return list(self._suspects)

    # ---- around every step (cheap when nothing failed) ---------------------------------------------------

    def before_schedule(self) -> None:
        """Isolates the suspect to probe next, if any (keeps the current one until it got through)."""
        if not self._suspects and self._probing is None:
            return
        if self._probing is not None and not self.is_live(self._probing):
            self._clear(self._probing)
        if self._probing is None:
            for rid in [r for r in self._suspects if not self.is_live(r)]:
                self._clear(rid)
            self._probing = next(iter(self._suspects), None)
            self._num_probe_samples = 0
            self.scheduler.isolate(self._probing)

    def prepare(self, scheduled: SchedulerOutput) -> SchedulerOutput:
        """The step's diff plus the rows the runner still has to drop after a failure."""
        if not self._drop_finished and not self._drop_preempted:
            return scheduled
        finished, preempted = self._drop_finished, self._drop_preempted
        self._drop_finished, self._drop_preempted = [], []
        return replace(scheduled, finished_request_ids=[*finished, *scheduled.finished_request_ids],
                       preempted_request_ids=[*preempted, *scheduled.preempted_request_ids])

    def completed(self, scheduled: SchedulerOutput) -> None:
        """A step ran: the probed suspect is cleared once it sampled PROBE_SAMPLES tokens alone."""
        if self._probing is None:
            return
        if any(c.request_id == self._probing and c.needs_sample for c in scheduled.chunks):
            self._num_probe_samples += 1
            if self._num_probe_samples >= PROBE_SAMPLES:
                self._clear(self._probing)

    # ---- after a failed step ----------------------------------------------------------------------------

    def judge(self, failure: StepFailed) -> Verdict:
        """Rolls back the failed steps' requests; says which are failed for good and which are suspects.
        The caller finishes the failed ones (reason "error")."""
        self._strikes = {rid: n for rid, n in self._strikes.items() if self.is_live(rid)}  # failures are rare
        ids = list(dict.fromkeys(c.request_id for step in failure.steps for c in step.chunks))
        for step in failure.steps:
            self._drop_finished.extend(step.finished_request_ids)
            self._drop_preempted.extend(step.preempted_request_ids)
        self._drop_preempted.extend(ids)
        for rid in ids:
            self._strikes[rid] = self._strikes.get(rid, 0) + 1
        alone = len(ids) == 1
        failed = {rid: _message(failure, alone) for rid in ids if alone or self._strikes[rid] >= self.max_strikes}
        admitted = {new.request_id for step in failure.steps for new in step.new_requests}
        rolled_back = sorted((rid for rid in ids if rid not in failed), key=lambda rid: rid not in admitted)
        self.scheduler.roll_back(ids)
        explained = self._suspects.get(ids[0]) if alone else None
        for rid in [r for r, group in self._suspects.items() if group == explained]:
            self._clear(rid)
        for rid in failed:
            self._clear(rid)
            self._strikes.pop(rid, None)
        self._num_failures += 1
        for rid in rolled_back:
            self._suspects[rid] = self._num_failures
        self._probing = None  # choose again: the failed work is redone alone, suspect by suspect
        self.scheduler.isolate(None)
        logger.warning("a step failed (%s) for requests %s: %s failed, %s rolled back to be run alone",
                       failure, ids[:8], list(failed)[:8], rolled_back[:8], exc_info=failure.cause)
        return Verdict(failed, rolled_back)

    def _clear(self, rid: str) -> None:
        self._suspects.pop(rid, None)
        if not self.is_live(rid):
            self._strikes.pop(rid, None)
        if self._probing == rid:
            self._probing = None
            self.scheduler.isolate(None)


def _message(failure: StepFailed, alone: bool) -> str:
    why = "it failed when run alone" if alone else f"it was in {MAX_STRIKES} failed steps"
    return f"the engine could not run this request ({why}): {failure}"
