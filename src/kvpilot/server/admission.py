"""Admission control: bound the queue of requests admitted but not yet running, instead of queueing forever.

A request holds its queue slot (and its prompt tokens) from admission until its first output (it is running)
or its end. Beyond `max_num_queued_reqs` or `max_num_queued_tokens` the server answers 429 with Retry-After
at once. Used only from the event loop, so plain counters suffice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.server.errors import APIError


@dataclass(frozen=True)
class QueueLimits:
    """None = no limit."""

    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None


class AdmissionController:
    """Invariants: num_queued_reqs / num_queued_tokens equal the sums over held tickets; never negative."""

    def __init__(self, limits: QueueLimits, retry_after_s: float = 1.0) -> None:
        self.limits = limits
        self.retry_after_s = retry_after_s
        self.num_queued_reqs = 0
        self.num_queued_tokens = 0
        self._held: dict[str, int] = {}

    def admit(self, request_id: str, num_prompt_tokens: int) -> None:
        """Takes a queue slot, or raises APIError 429 (code names the cap that was hit)."""
        reqs, tokens = self.limits.max_num_queued_reqs, self.limits.max_num_queued_tokens
        if reqs is not None and self.num_queued_reqs + 1 > reqs:
            raise self._busy(f"the queue holds {self.num_queued_reqs} waiting requests, the limit "
                             f"(--max-num-queued-reqs) is {reqs}", "queue_full_requests")
        # A prompt longer than the whole token cap is still let into an empty queue, so it cannot starve.
        if tokens is not None and self.num_queued_reqs and self.num_queued_tokens + num_prompt_tokens > tokens:
            raise self._busy(f"the queue holds {self.num_queued_tokens} prompt tokens and this request adds "
                             f"{num_prompt_tokens}, the limit (--max-num-queued-tokens) is {tokens}",
                             "queue_full_tokens")
        self._held[request_id] = num_prompt_tokens
        self.num_queued_reqs += 1
        self.num_queued_tokens += num_prompt_tokens

    def release(self, request_id: str) -> None:
        """Gives the slot back (first output, end, or failure); idempotent."""
        tokens = self._held.pop(request_id, None)
        if tokens is not None:
            self.num_queued_reqs -= 1
            self.num_queued_tokens -= tokens

    def _busy(self, reason: str, code: str) -> APIError:
        retry = max(1, math.ceil(self.retry_after_s))
        return APIError(429, f"server busy: {reason}; retry after {retry} s", code=code,
                        headers={"Retry-After": str(retry)})
