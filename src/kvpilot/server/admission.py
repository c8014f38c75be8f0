"""Admission control: bound the queue of requests admitted but not yet running, instead of queueing forever.

A request takes its queue slot on arrival, before it is tokenized (`reserve`: the request cap is decided
at once, without tokenizing, and a request being tokenized keeps its place), adds its prompt tokens once
they are known (`commit`: the token cap), and holds both until its first output (it is running) or its end.
Beyond `max_num_queued_reqs` or `max_num_queued_tokens` the server answers 429 with Retry-After at once.
Used only from the event loop, so plain counters suffice.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from kvpilot.server.openai.errors import APIError


@dataclass(frozen=True)
class QueueLimits:
    """None = no limit."""

    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None


class AdmissionController:
    """Invariants: num_queued_reqs == the number of held tickets (reserved or committed); num_queued_tokens ==
    the sum of their committed prompt tokens (a reserved ticket holds 0); never negative."""

    def __init__(self, limits: QueueLimits, retry_after_s: float = 1.0) -> None:
        self.limits = limits
        self.retry_after_s = retry_after_s
        self.num_queued_reqs = 0
        self.num_queued_tokens = 0
        self._held: dict[str, int] = {}

    def admit(self, request_id: str, num_prompt_tokens: int) -> None:
        """reserve() then commit(): takes a queue slot with its tokens, or raises APIError 429."""
        self.reserve(request_id)
        self.commit(request_id, num_prompt_tokens)

    def reserve(self, request_id: str) -> None:
        """Takes a queue slot before the prompt is tokenized, or raises APIError 429 queue_full_requests."""
        reqs = self.limits.max_num_queued_reqs
        if reqs is not None and self.num_queued_reqs + 1 > reqs:
            raise self._busy(f"the queue holds {self.num_queued_reqs} waiting requests, the limit "
                             f"(--max-num-queued-reqs) is {reqs}", "queue_full_requests")
        self._held[request_id] = 0
        self.num_queued_reqs += 1

    def commit(self, request_id: str, num_prompt_tokens: int) -> None:
        """Adds a reserved request's prompt tokens, or raises APIError 429 queue_full_tokens (and gives the
        slot back)."""
        if request_id not in self._held:
            raise KeyError(f"commit({request_id!r}) without reserve(): reserve the slot first")
        tokens = self.limits.max_num_queued_tokens
        # A prompt longer than the whole token cap is still let in when no other request holds tokens, so it
        # cannot starve.
        if tokens is not None and self.num_queued_tokens and self.num_queued_tokens + num_prompt_tokens > tokens:
            self.release(request_id)
            raise self._busy(f"the queue holds {self.num_queued_tokens} prompt tokens and this request adds "
                             f"{num_prompt_tokens}, the limit (--max-num-queued-tokens) is {tokens}",
                             "queue_full_tokens")
        self.num_queued_tokens += num_prompt_tokens - self._held[request_id]
        self._held[request_id] = num_prompt_tokens

    def release(self, request_id: str) -> None:
        """Gives the slot back (first output, end, or failure); idempotent."""
        tokens = self._held.pop(request_id, None)
        if tokens is not None:
            self.num_queued_reqs -= 1
            self.num_queued_tokens -= tokens

    def request_ids(self) -> Iterator[str]:
        """The ids holding a slot: arrived and not yet running (being tokenized included)."""
        return iter(self._held)

    def _busy(self, reason: str, code: str) -> APIError:
        retry = max(1, math.ceil(self.retry_after_s))
        return APIError(429, f"server busy: {reason}; retry after {retry} s", code=code,
                        headers={"Retry-After": str(retry)})
