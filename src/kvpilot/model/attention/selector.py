"""--attention-backend: which backend runs attention. `auto` picks the fastest that applies to the device
and dtypes: the C++ kernel backend for float32 on CPU (when it builds), else the torch reference."""

from __future__ import annotations

import torch

from kvpilot.model.attention.base import AttentionBackend
from kvpilot.model.attention.cpu_backend import CpuKernelAttentionBackend
from kvpilot.model.attention.torch_backend import TorchAttentionBackend
from kvpilot.model.errors import ModelLoadError

ATTENTION_BACKENDS = ("auto", "torch", "cpu")


def select_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                             kv_dtype: torch.dtype) -> AttentionBackend:
    """ModelLoadError names the backends that apply when the requested one does not."""
    if name not in ATTENTION_BACKENDS:
        raise ModelLoadError(f"unknown attention backend {name!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    kernel = CpuKernelAttentionBackend.applies(device, dtype, kv_dtype)
    if name == "cpu" and not kernel:
        raise ModelLoadError(f"the cpu attention backend needs float32 on a CPU and a C++ compiler (here: "
                             f"{dtype} on {device.type}): use --attention-backend auto or torch")
    if name == "cpu" or (name == "auto" and kernel):
        return CpuKernelAttentionBackend()
    return TorchAttentionBackend()
