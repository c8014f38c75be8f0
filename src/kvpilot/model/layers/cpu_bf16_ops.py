"""The C++ small ops for bfloat16 activations on CPU (csrc/bf16_ops_cpu.cpp: RMSNorm, a residual add fused with
the RMSNorm after it, rotary embedding and SiLU-and-mul; AVX-512 rows in csrc/bf16_ops_avx512.h, AVX2 rows in
csrc/bf16_ops_avx2.h, where the CPU has them), built once with torch's cpp_extension like the other CPU kernels.
Each call replaces several torch ops (two of RMSNorm's eight are dtype conversions); a decode step of a bf16
model runs 61 norms and 30 rotations.
None (the torch ops) when it cannot be built or KVPILOT_CPU_KERNELS=0.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from kvpilot.model.layers.cpp_build import CppKernel, build_cpp_kernel

_CSRC = Path(__file__).parent / "csrc"
# the vector rows (and their exp) first: the scalar ops' file calls them (one translation unit, no include path)
_KERNEL = CppKernel(label="CPU bf16 ops kernel", name_prefix="kvpilot_cpu_bf16_ops_",
                    sources=tuple(_CSRC / name for name in (
                        "simd_exp.h", "bf16_ops_avx512.h", "bf16_ops_avx2.h", "bf16_gemm_avx512.h", "bf16_gemm_amx.h",
                        "bf16_ops_cpu.cpp")),
                    functions=("rms_norm_bf16", "add_rms_norm_bf16", "rope_bf16", "silu_mul_bf16", "has_bf16_gemm",
                               "bf16_linear", "has_amx_bf16", "amx_linear"),
                    cflags=("-O3",),
                    serial="norms and rotations of long prompts run on one thread", fallback="using torch ops")


@lru_cache(maxsize=1)
def get_bf16_ops() -> Any | None:
    """The compiled module, or None when it cannot be built or is switched off."""
    return build_cpp_kernel(_KERNEL)


def bf16_ops_for(x: torch.Tensor) -> Any | None:
    """The module when `x` is a bfloat16 CPU tensor and the module builds; else None (use torch ops)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    return get_bf16_ops()


class CpuResidualOps:
    """The residual add fused into the next RMSNorm for bf16 rows on CPU: the `add_rms_norm` that
    LlamaForCausalLM's deferred-add layer loop takes (gpu_small_ops has the CUDA one)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, RMSNorm of it), bit for bit torch's bf16 add then RMSNorm.forward."""
        total, out = self.kernel.add_rms_norm_bf16(x.contiguous(), residual.contiguous(), weight, eps)
        return total, out


def residual_ops_for(x: torch.Tensor, norm_weight: torch.Tensor) -> CpuResidualOps | None:
    """CpuResidualOps for bf16 CPU rows whose norms have bf16 weights (where RMSNorm runs the C++ kernel)."""
    kernel = bf16_ops_for(x) if norm_weight.dtype == torch.bfloat16 else None
    return CpuResidualOps(kernel) if kernel is not None else None
