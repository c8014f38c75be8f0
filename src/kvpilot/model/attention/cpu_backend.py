"""The CPU backend: the torch backend's prefill, with decodes in the C++ kernel (layers/csrc), which reads
each K/V row once, in place, through the block table, for all decodes in one unpadded batch (no gather copy,
no padding, no bias tensor). For float32 / bf16 / fp16 queries (float32 math) with float32/bf16/fp16/fp8
K/V on CPU."""

from __future__ import annotations

import torch

from kvpilot.model.attention.metadata import DecodeBatch
from kvpilot.model.attention.torch_backend import TorchAttentionBackend
from kvpilot.model.layers.cpu_decode_kernel import kernel_applies
from kvpilot.model.layers.paged_attention import decode_kernel


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    batch_all_decodes = True

    @staticmethod
    def applies(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        return kernel_applies(device, dtype, kv_dtype)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, scale: float,
               out: torch.Tensor) -> None:
        if not decode_kernel(q, kv_cache, batch, scale, out):
            raise RuntimeError(f"the cpu attention backend cannot run {q.dtype} queries on {q.device} with "
                               f"{kv_cache.dtype} K/V: use --attention-backend torch")
