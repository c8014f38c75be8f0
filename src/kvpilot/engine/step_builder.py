"""StepBuilder: the scheduler's scratch state while it builds one step."""

from __future__ import annotations

from kvpilot.engine.scheduler_output import ScheduledChunk


class StepBuilder:
    """The chunks of the step being built and the token budget left (a preempted victim refunds its chunk).

    num_blocks_before: each scheduled request's table length before this step (its new blocks follow);
    admitted: requests new to the runner this step (first admission or resumption).
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.chunks: dict[str, ScheduledChunk] = {}
        self.num_blocks_before: dict[str, int] = {}
        self.admitted: set[str] = set()

    def add(self, chunk: ScheduledChunk, num_blocks_before: int, admitted: bool = False) -> None:
        self.chunks[chunk.request_id] = chunk
        self.num_blocks_before[chunk.request_id] = num_blocks_before
        if admitted:
            self.admitted.add(chunk.request_id)
        self.budget -= chunk.num_tokens

    def drop(self, request_id: str) -> None:
        chunk = self.chunks.pop(request_id, None)
        if chunk is not None:
            self.budget += chunk.num_tokens
