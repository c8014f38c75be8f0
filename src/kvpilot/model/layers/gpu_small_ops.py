"""Which small ops a CUDA tensor takes: the fused Triton kernels (triton_small_ops: RMSNorm, rotary,
SiLU-and-mul, fp8 row quantization) when triton imports, unless KVPILOT_TRITON_OPS=0; None means the torch ops. CPU tensors take
cpu_bf16_ops or torch, never these."""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import Any

import torch

ENV = "KVPILOT_TRITON_OPS"


@lru_cache(maxsize=1)
def _triton_small_ops() -> Any | None:
    if os.environ.get(ENV, "1") == "0" or importlib.util.find_spec("triton") is None:
        return None
    from kvpilot.model.layers import triton_small_ops  # imports triton
    return triton_small_ops


def small_ops_for(x: torch.Tensor) -> Any | None:
    """The Triton module for a CUDA tensor (when available and not switched off), else None."""
    if x.device.type != "cuda":
        return None
    return _triton_small_ops()
