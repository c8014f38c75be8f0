"""The CPU backend: decodes in the C++ kernel (layers/csrc), which reads each K/V row once, in place, through
the block table, for all decodes in one unpadded batch (no gather copy, no padding, no bias tensor), for float32
/ bf16 / fp16 queries (float32 math) with float32/bf16/fp16/fp8 K/V on CPU. Prompt chunks with bf16 queries and
K/V on an AVX512_BF16 CPU run the C++ flash-style prefill kernel (layers/cpu_prefill_kernel.py), others the
torch backend's scaled_dot_product_attention."""

from __future__ import annotations

import torch

from kvpilot.model.attention.metadata import DecodeBatch, PrefillSeq
from kvpilot.model.attention.torch_backend import TorchAttentionBackend
from kvpilot.model.layers.cpu_decode_kernel import kernel_applies
from kvpilot.model.layers.cpu_prefill_kernel import get_prefill_kernel, prefill_kernel_applies
from kvpilot.model.layers.paged_attention import decode_kernel


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    batch_all_decodes = True

    @staticmethod
    def applies(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        return kernel_applies(device, dtype, kv_dtype)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, seq: PrefillSeq,
                scale: float) -> torch.Tensor:
        if not prefill_kernel_applies(q, kv_cache):
            return super().prefill(q, k, v, kv_cache, seq, scale)
        queries = q[seq.query_start: seq.query_start + seq.query_len]
        out = torch.empty_like(queries)
        get_prefill_kernel().prefill_attention_bf16(out, queries, kv_cache[0], kv_cache[1], seq.block_ids,
                                                    seq.context_len - seq.query_len, scale)
        return out

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, scale: float,
               out: torch.Tensor) -> None:
        if not decode_kernel(q, kv_cache, batch, scale, out):
            raise RuntimeError(f"the cpu attention backend cannot run {q.dtype} queries on {q.device} with "
                               f"{kv_cache.dtype} K/V: use --attention-backend torch")
