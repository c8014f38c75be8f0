"""--attention-backend: which backend runs attention. `auto` picks the fastest that applies to the device
and dtypes: the Triton kernels on CUDA (when triton imports), the C++ kernel backend on CPU
(when it builds), else the torch reference. A model whose layers need attention variants (LayerAttention:
sliding window, logit soft-cap, sinks) gets only a backend that computes them all (check_backend_features)."""

from __future__ import annotations

import torch

from kvpilot.model.attention.base import ATTENTION_FEATURES, AttentionBackend, LayerAttention
from kvpilot.model.attention.cpu_backend import CpuKernelAttentionBackend
from kvpilot.model.attention.torch_backend import TorchAttentionBackend
from kvpilot.model.attention.triton_support import TRITON_FEATURES, triton_unusable_reason
from kvpilot.model.choices import ATTENTION_BACKENDS
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.layers.cpu_prefill_kernel import get_prefill_kernel


def _triton_backend() -> AttentionBackend:
    from kvpilot.model.attention.triton_backend import TritonAttentionBackend  # imports triton: only when usable
    return TritonAttentionBackend()


# what each backend computes beyond plain causal attention (the classes' `features`, readable without
# importing triton)
BACKEND_FEATURES: dict[str, frozenset[str]] = {
    TorchAttentionBackend.name: TorchAttentionBackend.features,
    CpuKernelAttentionBackend.name: CpuKernelAttentionBackend.features,
    "triton": TRITON_FEATURES,
}


def backends_computing(needed: frozenset[str]) -> tuple[str, ...]:
    """The backends (by --attention-backend name) that compute every variant in `needed`."""
    return tuple(name for name, features in BACKEND_FEATURES.items() if needed <= features)


def model_attention_features(model: torch.nn.Module) -> frozenset[str]:
    """The attention variants a model's layers use: the union of the `features` of every module's
    `layer_attention` (a LayerAttention). Read from the built layers, so it cannot drift from the config."""
    used: set[str] = set()
    for module in model.modules():
        layer = getattr(module, "layer_attention", None)
        if isinstance(layer, LayerAttention):
            used |= layer.features
    return frozenset(used)


def check_backend_features(backend: AttentionBackend, needed: frozenset[str],
                           requested: str = "auto") -> AttentionBackend:
    """`backend` when it computes every variant in `needed` (names from ATTENTION_FEATURES, which the model
    derives from its config); else, when the backend was `auto`'s choice, the torch reference (which
    computes them all); else ModelLoadError naming the backends that can run the model."""
    unknown = needed - ATTENTION_FEATURES
    if unknown:
        raise ValueError(f"unknown attention features {sorted(unknown)}: known are {sorted(ATTENTION_FEATURES)}")
    missing = needed - backend.features
    if not missing:
        return backend
    if requested == "auto":
        return TorchAttentionBackend()
    capable = " or ".join(f"--attention-backend {name}" for name in ("auto", *backends_computing(needed)))
    raise ModelLoadError(f"the {backend.name} attention backend does not compute {', '.join(sorted(missing))}, "
                         f"which this model's layers use: {capable} runs it")


def select_attention_backend(name: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                             needed: frozenset[str] = frozenset()) -> AttentionBackend:
    """ModelLoadError names the backends that apply when the requested one does not. needed: the attention
    variants the model's layers use (check_backend_features)."""
    return check_backend_features(_select(name, device, dtype, kv_dtype), needed, name)


def _select(name: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> AttentionBackend:
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
