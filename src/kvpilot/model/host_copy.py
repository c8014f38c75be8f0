"""A launched step's results on their way to the host, started at launch and read later.

A plain `.tolist()` of a CUDA tensor queues its copy behind every kernel launched so far: with async
scheduling the engine reads step N's tokens after launching step N+1, so the read waited for N+1 too and
nothing overlapped (async scheduling measured no faster than without; docs/benchmark-log.md). Here the copies
are queued right behind step N's sampling, into pinned host memory, and one event says when they landed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostCopy:
    """Host copies of `tensors`, begun now (asynchronously on CUDA). Invariant: wait() returns CPU tensors
    holding the values the device tensors had when this object was made, whatever ran on the device since."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if tensors and tensors[0].device.type == "cuda":
            self._host = [t.to("cpu", non_blocking=True) for t in tensors]  # pinned: an asynchronous copy
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = [t.detach().clone() for t in tensors]  # a later in-place op must not show

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once their copies have finished (waits for the copies' step only)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
