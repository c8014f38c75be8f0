"""The C++ paged decode-attention kernel on CPU, computing in float32 (csrc/: paged_decode_cpu.cpp, with vector
paths in decode_avx512.h and decode_avx2.h run by decode_vector.h; K/V stored as float32, bfloat16, float16 or fp8
e4m3), built once with torch's cpp_extension (JIT, cached on disk by torch under ~/.cache/torch_extensions).

Why: the torch-ops decode path gathers every sequence's K/V blocks into a new tensor each step and layer
(read + write + read); the kernel reads each K/V row once, in place, through the block table, one task per
(sequence, KV head) over torch's thread pool. `paged_decode_variant` adds a layer's sliding window (reading only
the window's blocks), logit soft-cap and attention sinks (kvpilot.model.attention.base.LayerAttention). If the
build is impossible (no compiler or ninja), or KVPILOT_CPU_KERNELS=0, `get_kernel()` returns None and the torch
path is used.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from kvpilot.model.layers.cpp_build import CppKernel, build_cpp_kernel

# concatenated in this order into one translation unit (the headers are not on an include path)
SOURCE_NAMES = ("decode_common.h", "simd_exp.h", "decode_avx512.h", "decode_avx2.h", "decode_vector.h",
                "paged_decode_cpu.cpp")
SOURCE_PATHS = tuple(Path(__file__).parent / "csrc" / name for name in SOURCE_NAMES)


_KERNEL = CppKernel(label="CPU decode kernel", name_prefix="kvpilot_cpu_decode_", sources=SOURCE_PATHS,
                    functions=("paged_decode", "paged_decode_variant", "parallel_width"),
                    cflags=("-O3", "-march=native", "-ffast-math"),
                    serial="decode attention runs on one thread", fallback="using the torch path")


@lru_cache(maxsize=1)
def get_kernel() -> Any | None:
    """The compiled module, or None when it cannot be built or is switched off."""
    return build_cpp_kernel(_KERNEL)


KERNEL_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
# Query dtypes: the kernel computes in float32; bfloat16 / float16 queries are widened first and the output
# narrowed after (a few KB per step: far cheaper than the torch path's gather of every K/V block).
KERNEL_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_applies(device: torch.device, compute_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether decode attention runs in the C++ kernel: CPU, a query dtype it widens, a KV dtype it widens."""
    return (device.type == "cpu" and compute_dtype in KERNEL_QUERY_DTYPES and kv_dtype in KERNEL_KV_DTYPES
            and get_kernel() is not None)
