"""--attention-backend: which backend runs attention. `auto` picks the fastest that applies to the device
and dtypes: the Triton kernels on CUDA (when triton imports), the C++ kernel backend on CPU
(when it builds), else the torch reference."""

from __future__ import annotations

import torch

from kvpilot.model.attention.base import AttentionBackend
from kvpilot.model.attention.cpu_backend import CpuKernelAttentionBackend
from kvpilot.model.attention.torch_backend import TorchAttentionBackend
from kvpilot.model.attention.triton_support import triton_unusable_reason
from kvpilot.model.choices import ATTENTION_BACKENDS
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.layers.cpu_prefill_kernel import get_prefill_kernel


def _triton_backend() -> AttentionBackend:
    from kvpilot.model.attention.triton_backend import TritonAttentionBackend  # imports triton: only when usable
    return TritonAttentionBackend()


def select_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                             kv_dtype: torch.dtype) -> AttentionBackend:
    """ModelLoadError names the backends that apply when the requested one does not."""
    if name not in ATTENTION_BACKENDS:
        raise ModelLoadError(f"unknown attention backend {name!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "triton":
        reason = triton_unusable_reason(device, dtype, kv_dtype)
        if reason is not None:
            raise ModelLoadError(f"the triton attention backend cannot run here: {reason}; or use "
                                 f"--attention-backend auto or torch")
        return _triton_backend()
    if name == "auto" and device.type == "cuda" and triton_unusable_reason(device, dtype, kv_dtype) is None:
        return _triton_backend()
    kernel = CpuKernelAttentionBackend.applies(device, dtype, kv_dtype)
    if name == "cpu" and not kernel:
        raise ModelLoadError(f"the cpu attention backend needs float32, bfloat16 or float16 on a CPU and a C++ "
                             f"compiler (here: {dtype} on {device.type}): use --attention-backend auto or torch")
    if name == "cpu" or (name == "auto" and kernel):
        if dtype == kv_dtype == torch.bfloat16:
            get_prefill_kernel()  # built at load (a minute the first time), not in the first request
        return CpuKernelAttentionBackend()
    return TorchAttentionBackend()
