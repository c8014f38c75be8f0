"""The C++ causal prefill-attention kernel on CPU for bfloat16 queries and K/V (csrc/prefill_attention_cpu.cpp,
after csrc/simd_exp.h): AVX512_BF16 dot products, flash-style, K/V read through the block table. Built with
-march=native (the module name carries the CPU's identity), so it exists only where the CPU has AVX512_BF16;
`prefill_kernel_applies` says when the cpu attention backend may use it instead of scaled_dot_product_attention.
`prefill_attention_bf16_variant` adds a layer's sliding window (reading only the blocks some query of the chunk
sees), logit soft-cap and attention sinks (kvpilot.model.attention.base.LayerAttention);
`prefill_attention_bf16_batch` runs a step's prompt chunks in one call, the work split between the threads by cost.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from kvpilot.model.layers.cpp_build import CppKernel, build_cpp_kernel

SOURCE_PATHS = tuple(Path(__file__).parent / "csrc" / name for name in ("simd_exp.h", "prefill_attention_cpu.cpp"))

_KERNEL = CppKernel(label="CPU prefill attention kernel", name_prefix="kvpilot_cpu_prefill_", sources=SOURCE_PATHS,
                    functions=("prefill_attention_bf16", "prefill_attention_bf16_variant",
                               "prefill_attention_bf16_batch", "prefill_kernel_available"),
                    cflags=("-O3", "-march=native"), serial="prefill attention runs on one thread",
                    fallback="using torch's scaled_dot_product_attention")
PREFILL_KERNEL_HEAD_DIMS = (64, 128)


@lru_cache(maxsize=1)
def get_prefill_kernel() -> Any | None:
    """The compiled module when it can run here (AVX512_BF16), else None."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return None  # no AVX-512 at all: not even worth a build
    kernel = build_cpp_kernel(_KERNEL)
    return kernel if kernel is not None and kernel.prefill_kernel_available() else None


def prefill_kernel_applies(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """CPU, bf16 queries and K/V, a head dim the kernel is compiled for, and the kernel built."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and kv_cache.dtype == torch.bfloat16
            and q.shape[-1] in PREFILL_KERNEL_HEAD_DIMS and get_prefill_kernel() is not None)
