"""dtype names accepted by --dtype, and what "auto" means on each device."""

from __future__ import annotations

from pathlib import Path

import torch

from kvpilot.fit.fingerprint import CPUINFO_PATH, cpu_flags
from kvpilot.model.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def cpu_has_fast_bf16(cpuinfo_path: str | Path = CPUINFO_PATH) -> bool:
    """True when the CPU computes bf16 natively (AVX512_BF16 or AMX). Without it, torch emulates bf16
    matmuls, which is 5-40x slower than float32 (measured on an AVX-512 Xeon without bf16)."""
    return bool(cpu_flags(Path(cpuinfo_path)) & {"avx512_bf16", "amx_bf16"})


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" is bfloat16 on GPUs and on CPUs with native bf16, else float32; float16 only on CUDA."""
    if name == "auto":
        if device.type == "cpu" and not cpu_has_fast_bf16():
            return torch.float32
        return torch.bfloat16
    if name not in DTYPES:
        raise ModelLoadError(f"dtype {name!r} is not supported; use auto, float32, bfloat16 or float16 (CUDA)")
    dtype = DTYPES[name]
    if dtype == torch.float16 and device.type != "cuda":
        raise ModelLoadError("float16 is only supported on CUDA (CPU half-precision matmuls are very slow); "
                             "use bfloat16 or float32")
    return dtype
