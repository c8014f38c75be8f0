"""release_omp_pool: hand the OpenMP worker threads of the calling thread back, before another thread of the
same process takes over the torch work (an engine thread started after the model ran on this one).

Why: libgomp keeps one pool of worker threads per thread that ever opened a parallel region, and once the
process holds more of its threads than CPUs it stops spinning between regions and sleeps at once
(`gomp_throttled_spin_count_var`). A decode step opens hundreds of short regions, so each then waits for
a futex wake-up: measured on a 2-vCPU EPYC, a 576x3072 packed Q4_1 matmul took 170 us on a thread started
after the main thread had used torch, 85 us without the main thread's idle pool. `omp_pause_resource_all`
(OpenMP 5.0) frees the caller's pool; the next region on this thread builds a new one.

Torch-free on purpose (the HTTP process calls it): it only acts on a libgomp already loaded in the process.
"""

from __future__ import annotations

import ctypes
import os

_OMP_PAUSE_SOFT = 1
_LIBGOMP = "libgomp.so.1"


def release_omp_pool() -> bool:
    """Frees the calling thread's idle OpenMP workers; True when a loaded libgomp did so. No-op (False) when
    no libgomp is loaded (torch not imported, or another OpenMP runtime) or it predates OpenMP 5.0.
    Invariant: safe to call any time outside a parallel region; later regions on this thread still run on
    all threads (libgomp builds a new pool)."""
    if not hasattr(os, "RTLD_NOLOAD"):
        return False
    try:
        lib = ctypes.CDLL(_LIBGOMP, mode=os.RTLD_NOLOAD)
        pause = lib.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(_OMP_PAUSE_SOFT) == 0
