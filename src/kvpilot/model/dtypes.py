"""dtype names accepted by --dtype, and what "auto" means on each device."""

from __future__ import annotations

import torch

from kvpilot.fit.fingerprint import cpu_has_fast_bf16
from kvpilot.model.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(name: str, device: torch.device, int8_packed: bool = False) -> torch.dtype:
    """"auto" is bfloat16 on GPUs, on CPUs with native bf16, and for a model whose linear weights all run packed on
    the CPU's int8 path (`int8_packed`; its int8 activations round about as coarsely as bf16, and the few bf16
    elementwise ops cost little beside the 2x faster int8 GEMMs of AVX2), else float32; float16 only on CUDA."""
    if name == "auto":
        if device.type == "cpu" and not cpu_has_fast_bf16() and not int8_packed:
            return torch.float32
        return torch.bfloat16
    if name not in DTYPES:
        raise ModelLoadError(f"dtype {name!r} is not supported; use auto, float32, bfloat16 or float16 (CUDA)")
    dtype = DTYPES[name]
    if dtype == torch.float16 and device.type != "cuda":
        raise ModelLoadError("float16 is only supported on CUDA (CPU half-precision matmuls are very slow); "
                             "use bfloat16 or float32")
    return dtype
