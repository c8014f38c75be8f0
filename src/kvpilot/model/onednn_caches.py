"""bound_onednn_caches: cap the two caches behind torch's CPU bf16 GEMMs before the first one runs.

Why: oneDNN keeps a primitive per GEMM shape (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, default 1,024) and
ideep, torch's wrapper, a computation per shape (`LRU_CACHE_CAPACITY`, default 1,024), each holding about
0.3-0.7 MiB here. A server's steps come in every row count up to its token budget, so at the defaults the
engine grows by up to ~1 GiB over hours (a one-hour soak grew by ~0.5 GiB and still rose). 256 entries ran as
fast as 1,024 and grew a quarter as much; 32 or 128 entries thrash (~10% slower), since a mixed run's
recurring decode batch sizes times five GEMM shapes (qkv, o, gate_up, down, lm_head) need more (the figures:
docs/benchmark-log.md, "Figures moved out of the code").

Both libraries read the variables when they create their first cached object, not at import, so this works
after `import torch` as long as no bf16 GEMM has run yet. A value the user set is kept. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULT_CACHE_CAPACITY = 256
CACHE_CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = DEFAULT_CACHE_CAPACITY,
                        environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets each cache-capacity variable that is unset to `capacity`; returns the values now in force.
    Invariant: never overrides a value already in the environment."""
    env = os.environ if environ is None else environ
    for name in CACHE_CAPACITY_VARIABLES:
        env.setdefault(name, str(capacity))
    return {name: env[name] for name in CACHE_CAPACITY_VARIABLES}
