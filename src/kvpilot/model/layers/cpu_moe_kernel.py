"""The C++ mixture-of-experts kernel on CPU for bfloat16 (csrc/moe_experts_cpu.cpp): a step's tokens through their
chosen experts in two parallel regions a layer, AVX512_BF16 dot products on the weights' plain stacked layout.
Built with -march=native (the module name carries the CPU's identity), so it exists only where the CPU has
AVX512_BF16; `moe_kernel_for` says when layers.moe may use it.

Why for every step, prompts too: per-expert oneDNN GEMMs cost two parallel regions an expert, and an expert's
rows stay few even in long steps (a 1,024-token step spreads 8,192 pairs over Qwen3-30B-A3B's 128 experts);
the kernel was faster at 1 to 1,024 tokens (docs/benchmark-log.md, "MoE experts on CPU").
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from kvpilot.model.layers.cpp_build import CppKernel, build_cpp_kernel

_SOURCE_NAMES = ("moe_groups.h", "moe_experts_cpu.cpp")  # one translation unit, in this order
_KERNEL = CppKernel(label="CPU MoE experts kernel", name_prefix="kvpilot_cpu_moe_",
                    sources=tuple(Path(__file__).parent / "csrc" / name for name in _SOURCE_NAMES),
                    functions=("moe_experts_bf16", "moe_kernel_available"), cflags=("-O3", "-march=native"),
                    serial="mixture-of-experts decode steps run on one thread",
                    fallback="using oneDNN GEMMs per expert")


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
