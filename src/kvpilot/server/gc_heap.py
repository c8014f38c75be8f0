"""freeze_startup_heap: the objects alive once a server process has started (model, tokenizer, app) leave the
cyclic garbage collector's view, so its full collections scan only what requests create.

Why: a full (generation 2) collection walks every tracked object of the process; in an engine core that is
the model's modules, the tokenizer and the engine, and one pass took a tenth of a second on a small CPU
(docs/benchmark-log.md): a stall of every stream, whenever enough requests' objects have survived to trigger
one. vLLM freezes its engine core's start-up heap the same way. Only for processes that live as long as the server:
objects frozen are never collected, so a process that builds and drops engines (tests, `LLM` users) must
not call it.

Loading also leaves the C heap with freed space (a model's temporaries: ~115 MiB for the embedded model's Q4_K_M
copy); glibc keeps it mapped until malloc_trim returns it to the system, so the process's resident memory drops
to what it holds.
"""

from __future__ import annotations

import ctypes
import gc


def freeze_startup_heap() -> int:
    """Collects once (start-up's garbage is not kept forever), then freezes what is left and returns the C heap's
    free space to the system; returns how many objects are frozen now."""
    gc.collect()
    gc.freeze()
    release_free_heap()
    return gc.get_freeze_count()


def release_free_heap() -> bool:
    """glibc's malloc_trim(0): free heap pages back to the system. False where the C library has none (musl,
    macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
