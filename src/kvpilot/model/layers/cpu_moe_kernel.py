"""The C++ mixture-of-experts kernel on CPU for bfloat16 (csrc/moe_experts_cpu.cpp): a decode step's few tokens
through their chosen experts in two parallel regions a layer, AVX512_BF16 dot products on the weights' plain
stacked layout. Built with -march=native (the module name carries the CPU's identity), so it exists only where
the CPU has AVX512_BF16; `moe_kernel_for` says when layers.moe may use it.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from kvpilot.model.layers.cpp_build import CppKernel, build_cpp_kernel

_KERNEL = CppKernel(label="CPU MoE experts kernel", name_prefix="kvpilot_cpu_moe_",
                    sources=(Path(__file__).parent / "csrc" / "moe_experts_cpu.cpp",),
                    functions=("moe_experts_bf16", "moe_kernel_available"), cflags=("-O3", "-march=native"),
                    serial="mixture-of-experts decode steps run on one thread",
                    fallback="using oneDNN GEMMs per expert")
# Tokens up to which a step takes the kernel: it reads each chosen expert's rows once for all of its tokens but
# multiplies them row by row (no register tiling across tokens); longer steps are compute-bound GEMMs.
MAX_KERNEL_TOKENS = 16


@lru_cache(maxsize=1)
def get_moe_kernel() -> Any | None:
    """The compiled module when it can run here (AVX512_BF16), else None."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return None  # no AVX-512 at all: not even worth a build
    kernel = build_cpp_kernel(_KERNEL)
    return kernel if kernel is not None and kernel.moe_kernel_available() else None


def moe_kernel_for(weight: torch.Tensor) -> Any | None:
    """The module for bf16 expert weights on the CPU where it builds, else None."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    return get_moe_kernel()
