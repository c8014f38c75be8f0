"""StepBuilder: the scheduler's scratch state while it builds one step."""

from __future__ import annotations

from typing import NamedTuple

from kvpilot.engine.request import Request
from kvpilot.engine.scheduler_output import ScheduledChunk


class StepEntry(NamedTuple):
    """One scheduled request: its chunk, its table length before this step (its new blocks follow), and
    whether it is new to the runner this step (first admission or resumption)."""

    request: Request
    chunk: ScheduledChunk
    num_blocks_before: int
    admitted: bool


class StepBuilder:
    """The chunks of the step being built, in scheduling order, and the token budget left (a preempted
    victim refunds its chunk). One dict entry per request: this runs for every request every step.
    drafts: the draft tokens of the chunks that verify some (speculative decoding), by request id."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._max_budget = budget
        self.entries: dict[str, StepEntry] = {}
        self.drafts: dict[str, list[int]] = {}

    @property
    def num_tokens(self) -> int:
        """The tokens of the chunks added and not dropped."""
        return self._max_budget - self.budget

    def add(self, request: Request, chunk: ScheduledChunk, num_blocks_before: int, admitted: bool = False) -> None:
        self.entries[chunk.request_id] = StepEntry(request, chunk, num_blocks_before, admitted)
        self.budget -= chunk.num_tokens

    def add_drafts(self, request: Request, chunk: ScheduledChunk, num_blocks_before: int, drafts: list[int]) -> None:
        """A running request's chunk that computes its last known token and then `drafts`."""
        self.add(request, chunk, num_blocks_before)
        self.drafts[chunk.request_id] = drafts

    def drop(self, request_id: str) -> None:
        entry = self.entries.pop(request_id, None)
        if entry is not None:
            self.budget += entry.chunk.num_tokens
        if self.drafts:
            self.drafts.pop(request_id, None)
