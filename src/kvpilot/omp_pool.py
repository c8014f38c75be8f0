"""kvpilot's handling of libgomp, the OpenMP runtime under torch's CPU ops and kvpilot's C++ kernels: a short
spin before a waiting thread sleeps (prefer_short_omp_spin), and release_omp_pool, which hands the OpenMP worker
threads of the calling thread back before another thread of the same process takes over the torch work (an
engine thread started after the model ran on this one).

The spin: a thread that finishes its share of a parallel region waits at the barrier for the others, spinning
~300,000 rounds (a few ms) by default before it sleeps. On a machine whose cores other processes also use (a
shared box, CI neighbours, a client beside the server) the thread it waits for may have no CPU: the spinning
one holds a core through its timeslice, and a decode step of hundreds of regions took 5-10x as long
(benchmarks/omp_wait.py; docs/benchmark-log.md). SHORT_SPIN_COUNT rounds keep the quiet machine's speed (the
regions of a step follow each other within microseconds) and give the core up soon when it is contended.

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
SHORT_SPIN_COUNT = 3000
_USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def prefer_short_omp_spin(environ: dict[str, str] | None = None) -> bool:
    """Sets GOMP_SPINCOUNT=SHORT_SPIN_COUNT for the libgomp this process (and the processes it starts) will
    load; True when it did. Leaves everything as it is when the user set GOMP_SPINCOUNT or OMP_WAIT_POLICY, or
    when libgomp is already loaded (torch imported before kvpilot: libgomp read its environment then, and a
    changed variable would only surprise this process's children). `environ` is os.environ unless given."""
    env = os.environ if environ is None else environ
    cannot_tell = not hasattr(os, "RTLD_NOLOAD")  # whether libgomp is loaded: change nothing
    if any(name in env for name in _USER_SETTINGS) or cannot_tell or _loaded_libgomp() is not None:
        return False
    env["GOMP_SPINCOUNT"] = str(SHORT_SPIN_COUNT)
    return True


def _loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp already loaded in this process, without loading it; None when there is none (or the platform
    has no RTLD_NOLOAD to ask with)."""
    if not hasattr(os, "RTLD_NOLOAD"):
        return None
    try:
        return ctypes.CDLL(_LIBGOMP, mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def release_omp_pool() -> bool:
    """Frees the calling thread's idle OpenMP workers; True when a loaded libgomp did so. No-op (False) when
    no libgomp is loaded (torch not imported, or another OpenMP runtime) or it predates OpenMP 5.0.
    Invariant: safe to call any time outside a parallel region; later regions on this thread still run on
    all threads (libgomp builds a new pool)."""
    lib = _loaded_libgomp()
    if lib is None:
        return False
    try:
        pause = lib.omp_pause_resource_all
    except AttributeError:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(_OMP_PAUSE_SOFT) == 0
