"""release_omp_pool frees the calling thread's OpenMP workers and nothing else: with torch loaded it finds
the process's libgomp and succeeds, and the kernels' next parallel regions (on this thread and on another)
still run on all of torch's threads."""

from __future__ import annotations

import threading

import pytest
import torch

from kvpilot.model.layers.cpu_decode_kernel import get_kernel
from kvpilot.omp_pool import release_omp_pool

pytestmark = pytest.mark.skipif(get_kernel() is None, reason="no C++ toolchain: no OpenMP kernels")


def test_release_keeps_every_thread_working() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert get_kernel().parallel_width() == 2  # this thread now owns a pool
        assert release_omp_pool() is True
        widths: list[int] = []
        worker = threading.Thread(target=lambda: widths.append(get_kernel().parallel_width()))
        worker.start()
        worker.join()
        assert widths == [2]
        assert get_kernel().parallel_width() == 2  # a new pool on this thread
    finally:
        torch.set_num_threads(before)
