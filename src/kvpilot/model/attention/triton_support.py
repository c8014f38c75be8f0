"""Whether the Triton backend can run here: triton importable, and a CUDA device (or, for tests on a machine
without one, Triton's interpreter: TRITON_INTERPRET=1, which runs the kernels with numpy on CPU tensors).

The kernel modules (triton_kv_write, triton_prefill, triton_decode) import triton at module level; import
them only after triton_usable() says yes. TRITON_INTERPRET must be set before they are imported (triton.jit
picks the interpreter when it decorates)."""

from __future__ import annotations

import importlib.util
import os

import torch

from kvpilot.model.attention.base import ATTENTION_FEATURES

INTERPRET_ENV = "TRITON_INTERPRET"
# the LayerAttention variants the Triton kernels compute (TritonAttentionBackend.features)
TRITON_FEATURES: frozenset[str] = ATTENTION_FEATURES


def triton_importable() -> bool:
    """triton is installed (CUDA builds of torch ship it; on CPU: pip install 'kvpilot[gpu]')."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton's interpreter is on (kernels run on CPU tensors, slowly: for tests)."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def triton_unusable_reason(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """None when the Triton backend can run attention for `dtype` queries over `kv_dtype` K/V on `device`,
    else what to do instead."""
    if not triton_importable():
        return "triton is not installed (pip install 'kvpilot[gpu]', or use a CUDA build of torch)"
    if device.type == "cuda":
        fp8 = kv_dtype == torch.float8_e4m3fn
        if fp8 and torch.cuda.get_device_capability(device) < (8, 9):
            return "fp8 (e4m3) K/V need compute capability 8.9 or newer (Ada, Hopper): use kv_cache_dtype bfloat16"
        return None
    if not interpreting():
        return f"Triton kernels need a CUDA device (here: {device.type}; TRITON_INTERPRET=1 runs them on CPU, slowly)"
    if dtype == torch.bfloat16:  # triton-lang/triton#11584: the interpreter multiplies bf16 bit patterns in tl.dot
        return "Triton's interpreter computes bfloat16 dot products wrongly: use --dtype float16 or float32"
    return None
