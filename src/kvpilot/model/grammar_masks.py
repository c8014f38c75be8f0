"""MaskWorkers: threads that advance constrained rows' llguidance matchers off the step's critical path.

A row's grammar work for its next sample (feed it the token just sampled, then compute the mask of the tokens
that may follow) starts as soon as that token is known, in a worker thread, and is collected when the next
step samples: it overlaps the engine's host work and the next forward instead of adding to them. llguidance
drops the GIL while it computes a mask, so the workers run in parallel with the engine and each other.

Each job measures its own CPU time (the thread's, so other threads' load does not count against it): that is
what GrammarLimits.max_mask_ms budgets per request. One job per row at a time (the state that submits waits
for a row's job before it submits the next one); a job whose row was dropped meanwhile runs to its end on
a matcher nobody uses any more (llguidance's fuel limits bound how long).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class MaskOutcome:
    """One job's result: the mask (int32 [words], bit j of word w set = token 32w + j allowed), llguidance's
    error ('' if none; the mask is then meaningless) and the job's CPU seconds."""

    mask: np.ndarray
    error: str
    cpu_seconds: float


def advance(matcher: Any, token_ids: Sequence[int], num_words: int) -> MaskOutcome:
    """Feeds `token_ids` (none past the grammar's end: async scheduling samples one token after EOS, which is
    discarded) and computes the next mask."""
    from llguidance.numpy import fill_next_token_bitmask

    started = time.thread_time()
    mask = np.zeros((1, num_words), dtype=np.int32)
    if token_ids and not matcher.is_stopped() and not matcher.consume_tokens(list(token_ids)):
        return MaskOutcome(mask[0], matcher.get_error() or f"the grammar rejected tokens {list(token_ids)[:8]}",
                           time.thread_time() - started)
    fill_next_token_bitmask(matcher, mask, 0)
    error = matcher.get_error() if matcher.is_error() else ""
    return MaskOutcome(mask[0], error, time.thread_time() - started)


class MaskWorkers:
    """The worker threads (started on first use, at most one per core and per row)."""

    def __init__(self, max_rows: int) -> None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
        self._pool = ThreadPoolExecutor(max(1, min(max_rows, cores)), thread_name_prefix="kvpilot-grammar")

    def submit(self, matcher: Any, token_ids: Sequence[int], num_words: int) -> Future[MaskOutcome]:
        return self._pool.submit(advance, matcher, list(token_ids), num_words)
