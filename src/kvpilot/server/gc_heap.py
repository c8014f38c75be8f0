"""freeze_startup_heap: the objects alive once a server process has started (model, tokenizer, app) leave the
cyclic garbage collector's view, so its full collections scan only what requests create.

Why: a full (generation 2) collection walks every tracked object of the process; in an engine core that is
the model's modules, the tokenizer and the engine, and one pass took up to ~90-130 ms on a 2-vCPU EPYC
(2026-11-28) — a stall of every stream, whenever enough requests' objects have survived to trigger one. vLLM
freezes its engine core's start-up heap the same way. Only for processes that live as long as the server:
objects frozen are never collected, so a process that builds and drops engines (tests, `LLM` users) must
not call it.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects once (start-up's garbage is not kept forever), then freezes what is left; returns how many
    objects are frozen now."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
