"""Builds the C++ CPU kernels a CPU model will use all at once, one compiler per core, before the model loads.

Why: each kernel is its own translation unit that torch's cpp_extension compiles when first asked for (cached
on disk after that), and loading asked for them one after another: on a fresh 2-core machine the first start
waited for five single-threaded compiles in a row. Built together they take about half as long. Each getter
still caches its module (lru_cache), so the later calls from the loader, the attention selector and the layers
find it built; a kernel that cannot be built is None there as before (and warned about once, here).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvpilot.model.fused_decode import get_fused_decode_kernel
from kvpilot.model.layers.cpu_bf16_ops import get_bf16_ops
from kvpilot.model.layers.cpu_decode_kernel import get_kernel
from kvpilot.model.layers.cpu_prefill_kernel import get_prefill_kernel
from kvpilot.model.quant.kernel import get_quant_kernel


def kernels_for(dtype: torch.dtype) -> tuple[Callable[[], Any], ...]:
    """The getters of the kernels a CPU model of this activation dtype may call: decode attention, the packed
    linear layers and the fused decode always; with bfloat16 also prefill attention and the small ops."""
    every = (get_kernel, get_quant_kernel, get_fused_decode_kernel)
    return every + (get_prefill_kernel, get_bf16_ops) if dtype == torch.bfloat16 else every


def build_cpu_kernels(getters: Sequence[Callable[[], Any]], max_workers: int | None = None) -> None:
    """Calls every getter (each builds its kernel, or finds it in torch's cache), up to one per core at once
    (`max_workers`: at most that many); returns when all have. A no-op with KVPILOT_CPU_KERNELS=0."""
    if os.environ.get("KVPILOT_CPU_KERNELS", "1") == "0" or not getters:
        return
    workers = max(1, min(len(getters), max_workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvpilot-kernel-build") as pool:
        for _ in pool.map(lambda getter: getter(), getters):
            pass
