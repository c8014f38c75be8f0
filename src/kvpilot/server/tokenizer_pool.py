"""TokenizerPool: the worker threads that tokenize prompts, so the event loop never does.

A 10 MB prompt takes seconds to tokenize; on the event loop that froze /health and every other client's
stream for as long. Two bounded lanes, so that huge prompts cannot hold up small ones either: a prompt of
`large_size` characters (or token ids) or more goes to the large lane, everything else to the small lane.
Each lane has a few threads (one for huge prompts by default: they then cost the engine at most one core,
and only delay each other); work beyond them waits in the lane's queue (bounded in practice by the
admission caps: a request holds its queue slot while it is tokenized).

The work itself must release the GIL to help (see prompt_tokens.py): a thread that holds it freezes the
loop just the same. The threads keep the process's priority: lowering it (tried: nice +10 on the large
lane) let a huge prompt's thread be descheduled while it held the GIL for a moment, and /health then
waited for it (0.57 s instead of 0.09 s at worst on a loaded 2-vCPU box).
"""

from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

# ~50 ms of tokenizing on one core of the 2-vCPU developer box (about 2 MB/s of English text).
LARGE_PROMPT_SIZE = 100_000
MAX_SMALL_WORKERS = 8


def default_small_workers() -> int:
    """Half the cores this process may run on, 2 to 8: a burst of 256 prompts of 512 tokens (~1 ms each) waited
    ~130 ms for 2 threads on a 16-core GPU host, while the engine core and the event loop need the rest."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(2, min(MAX_SMALL_WORKERS, cores // 2))


class TokenizerPool:
    """Invariants: at most small_workers + large_workers threads ever run; threads start on first use;
    after shutdown() nothing new is accepted (RuntimeError) and queued work is cancelled."""

    def __init__(self, small_workers: int | None = None, large_workers: int = 1,
                 large_size: int = LARGE_PROMPT_SIZE) -> None:
        small_workers = default_small_workers() if small_workers is None else small_workers
        if small_workers < 1 or large_workers < 1:
            raise ValueError(f"a TokenizerPool needs >= 1 worker per lane, got {small_workers} and {large_workers}")
        self.large_size = large_size
        self._small = ThreadPoolExecutor(small_workers, thread_name_prefix="kvpilot-tokenize")
        self._large = ThreadPoolExecutor(large_workers, thread_name_prefix="kvpilot-tokenize-large")

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker of the lane for `size`; its exception (e.g. APIError) is re-raised here.
        Cancelling the caller does not stop a running fn: its result is dropped."""
        lane = self._large if size >= self.large_size else self._small
        return await asyncio.get_running_loop().run_in_executor(lane, functools.partial(fn, *args))

    def shutdown(self) -> None:
        """Stops accepting work and cancels what waits; returns at once (a running fn finishes alone)."""
        for lane in (self._small, self._large):
            lane.shutdown(wait=False, cancel_futures=True)

