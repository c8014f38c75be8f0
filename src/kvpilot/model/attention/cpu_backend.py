"""The CPU backend: decodes in the C++ kernel (layers/csrc), which reads each K/V row once, in place, through
the block table, for all decodes in one unpadded batch (no gather copy, no padding, no bias tensor), for float32
/ bf16 / fp16 queries (float32 math) with float32/bf16/fp16/fp8 K/V on CPU. Prompt chunks with bf16 queries and
K/V on an AVX512_BF16 CPU run the C++ flash-style prefill kernel (layers/cpu_prefill_kernel.py), all of a step's
chunks in one call, others the torch backend's scaled_dot_product_attention.

Both kernels compute every LayerAttention variant (sliding window, logit soft-cap, sinks). Sliding window
invariant: a block-table entry whose block lies wholly before the window of every query of the step is never
read, by the kernels (they start at the window's first block) or by the torch paths (see TorchAttentionBackend).
"""

from __future__ import annotations

import torch

from kvpilot.engine.kv_groups import MAX_KV_GROUPS
from kvpilot.model.attention.base import ATTENTION_FEATURES, LayerAttention, as_layer_attention
from kvpilot.model.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSeq
from kvpilot.model.attention.torch_backend import TorchAttentionBackend
from kvpilot.model.layers.cpu_decode_kernel import kernel_applies
from kvpilot.model.layers.cpu_prefill_kernel import get_prefill_kernel, prefill_kernel_applies
from kvpilot.model.layers.paged_attention import NO_SINKS, decode_kernel


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    batch_all_decodes = True
    features: frozenset[str] = ATTENTION_FEATURES
    # the batched prefill kernel's arguments by id of the step's metadata (one per KV group; the metadata kept with
    # them, so an id is not reused while cached), cleared when a new step's would make more than MAX_KV_GROUPS
    _spans: dict[int, tuple[AttentionMetadata, tuple[torch.Tensor, ...]]]

    def __init__(self) -> None:
        super().__init__()
        self._spans = {}

    @staticmethod
    def applies(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        return kernel_applies(device, dtype, kv_dtype)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, seq: PrefillSeq,
                layer: LayerAttention | float) -> torch.Tensor:
        if not prefill_kernel_applies(q, kv_cache):
            return super().prefill(q, k, v, kv_cache, seq, layer)
        layer = as_layer_attention(layer)
        queries = q[seq.query_start: seq.query_start + seq.query_len]
        out = torch.empty_like(queries)
        sinks = layer.sinks.contiguous() if layer.sinks is not None else NO_SINKS
        get_prefill_kernel().prefill_attention_bf16_variant(
            out, queries, kv_cache[0], kv_cache[1], seq.block_ids, seq.context_len - seq.query_len, layer.scale,
            layer.window, layer.softcap, sinks)
        return out

    def prefill_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, layer: LayerAttention, out: torch.Tensor) -> None:
        """All of the step's prompt chunks in one prefill kernel call where it applies (its rows equal the
        per-chunk calls' bit for bit), else the torch backend's a chunk at a time."""
        if not meta.prefills or not prefill_kernel_applies(q, kv_cache):
            super().prefill_rows(q, k, v, kv_cache, meta, layer, out)
            return
        sinks = layer.sinks.contiguous() if layer.sinks is not None else NO_SINKS
        get_prefill_kernel().prefill_attention_bf16_batch(
            out, q, kv_cache[0], kv_cache[1], *self._prefill_spans(meta), layer.scale, layer.window, layer.softcap,
            sinks)

    def _prefill_spans(self, meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        """The batched kernel's block_tables [S, max_blocks], query_starts, query_lens and starts [S] of `meta`'s
        prompt chunks: built at a step's first layer of each KV group, kept for its other layers (the same metadata
        object)."""
        cache = self._spans
        hit = cache.get(id(meta))
        if hit is not None and hit[0] is meta:
            return hit[1]
        seqs = meta.prefills
        tables = torch.zeros(len(seqs), max(len(s.block_ids) for s in seqs), dtype=torch.int64)
        for row, seq in zip(tables, seqs):
            row[:len(seq.block_ids)] = seq.block_ids
        columns = torch.tensor([(s.query_start, s.query_len, s.context_len - s.query_len) for s in seqs],
                               dtype=torch.int64).t().contiguous()
        if len(cache) >= MAX_KV_GROUPS:
            cache.clear()
        cache[id(meta)] = (meta, (tables, *columns))
        return cache[id(meta)][1]

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, layer: LayerAttention | float,
               out: torch.Tensor) -> None:
        if not decode_kernel(q, kv_cache, batch, layer, out):
            raise RuntimeError(f"the cpu attention backend cannot run {q.dtype} queries on {q.device} with "
                               f"{kv_cache.dtype} K/V: use --attention-backend torch")
