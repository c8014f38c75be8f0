"""The reference backend: plain torch ops over the paged cache, any device and dtype.

Prompt chunks run scaled_dot_product_attention per sequence; decodes of similar context length are
batched into one masked bmm over their gathered blocks (on CPU ~5x faster than SDPA for single queries).
Every LayerAttention variant (sliding window, logit soft-cap, sinks) is computed exactly as HF transformers
does (layers/paged_attention.py): the reference the other backends are tested against.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpilot.model.attention.base import ATTENTION_FEATURES, LayerAttention, as_layer_attention
from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.metadata import (AttentionMetadata, DecodeBatch, PrefillSeq, host_tensor,
                                               make_decode_batch)
from kvpilot.model.layers.paged_attention import decode_torch, prefill_attention, write_kv

DECODE_GROUP_SPREAD = 1.5  # a group's longest block table is at most this times its shortest...
MIN_DECODE_GROUP = 8  # ...unless the group is still small (tiny matmuls cost more than padding)


def _prefill_mask(start: int, query_len: int, device: torch.device) -> torch.Tensor | None:
    if start == 0:
        return None
    query_pos = torch.arange(start, start + query_len, device=device)[:, None]
    key_pos = torch.arange(start + query_len, device=device)[None, :]
    return key_pos <= query_pos


def build_prefills(layout: StepLayout, device: torch.device, is_decode: np.ndarray) -> list[PrefillSeq]:
    """One PrefillSeq per non-decode sequence (a handful per step: a Python loop is fine here); `is_decode`
    is layout.is_decode (the caller's, computed once a step, which skips this call on an all-decode step)."""
    prefills = []
    context_lens = layout.context_lens
    for i in np.flatnonzero(~is_decode):
        start, query_len, context_len = int(layout.start_positions[i]), int(layout.query_lens[i]), int(context_lens[i])
        num_blocks = -(-context_len // layout.block_size)
        block_ids = torch.from_numpy(layout.block_tables[i, :num_blocks].copy()).to(device)
        prefills.append(PrefillSeq(int(layout.query_start[i]), query_len, context_len, block_ids,
                                   _prefill_mask(start, query_len, device)))
    return prefills


def group_by_context(num_blocks: np.ndarray) -> list[np.ndarray]:
    """Indices into num_blocks, grouped so padding each group to its longest table wastes little."""
    order = np.argsort(num_blocks, kind="stable")
    groups: list[list[int]] = []
    for i in order.tolist():
        group = groups[-1] if groups else None
        if group is None or (num_blocks[i] > DECODE_GROUP_SPREAD * num_blocks[group[0]]
                             and len(group) >= MIN_DECODE_GROUP):
            groups.append([i])
        else:
            group.append(i)
    return [np.asarray(g, dtype=np.int64) for g in groups]


class TorchAttentionBackend:
    """KV layout per layer: [2, kv_heads, num_blocks, block_size, head_dim] (K then V), head-major so a
    gather by block id yields [kv_heads, tokens, head_dim] with no transpose.

    Sliding window invariant: a block-table entry whose block lies wholly before the window of every query of
    the step is never read (the KV manager may point it at a reused or null block): prompt chunks gather from
    the first query's window on, decodes gather only their window's blocks and mask with a select (NaN-proof)."""

    name = "torch"
    features: frozenset[str] = ATTENTION_FEATURES
    batch_all_decodes = False  # the kernel backend takes every decode in one unpadded batch

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def build(self, layout: StepLayout, device: torch.device, *, group: int = 0) -> AttentionMetadata:
        """`group` is not needed: each call builds new tensors."""
        all_decode = layout.all_decode
        is_decode = None if all_decode else layout.is_decode
        return AttentionMetadata(slot_mapping=host_tensor(layout.slot_mapping, device),
                                 prefills=[] if all_decode else build_prefills(layout, device, is_decode),
                                 decodes=self._decode_batches(layout, device, is_decode, all_decode),
                                 num_tokens=layout.num_tokens)

    def _decode_batches(self, layout: StepLayout, device: torch.device, is_decode: np.ndarray | None,
                        all_decode: bool) -> list[DecodeBatch]:
        """is_decode: layout.is_decode, None when all_decode (not needed then)."""
        if all_decode:  # a decode step: every sequence, rows 0..n-1 in order
            context_lens, tables, rows = layout.context_lens, layout.block_tables, layout.query_start
            consecutive: bool | None = True
        else:
            decodes = np.flatnonzero(is_decode)
            if len(decodes) == 0:
                return []
            context_lens = layout.context_lens[decodes]
            tables, rows = layout.block_tables[decodes], layout.query_start[decodes]
            consecutive = None
        if self.batch_all_decodes:
            # no padding to size (no bias): the layout's tables, however wide, are the kernel's
            return [make_decode_batch(tables, context_lens, rows, layout.block_size, device, with_bias=False,
                                      consecutive=consecutive, max_blocks=tables.shape[1])]
        num_blocks = -(-context_lens // layout.block_size)
        return [make_decode_batch(tables[g], context_lens[g], rows[g], layout.block_size, device)
                for g in group_by_context(num_blocks)]

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, seq: PrefillSeq,
                layer: LayerAttention | float) -> torch.Tensor:
        """The sequence's rows of the output ([query_len, heads, D]); its K/V are already in kv_cache."""
        return prefill_attention(q, k, v, kv_cache, seq, layer)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, layer: LayerAttention | float,
               out: torch.Tensor) -> None:
        """Writes the batch's rows of `out`."""
        result = decode_torch(q, kv_cache, batch, layer)
        if batch.row_range is not None:
            batch.rows_of(out).copy_(result)
        else:
            out[batch.token_rows] = result

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, layer: LayerAttention | float) -> torch.Tensor:
        """layer: the layer's LayerAttention (a bare scale: plain causal attention)."""
        layer = as_layer_attention(layer)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        self.prefill_rows(q, k, v, kv_cache, meta, layer, out)
        for batch in meta.decodes:
            self.decode(q, kv_cache, batch, layer, out)
        return out

    def prefill_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, layer: LayerAttention, out: torch.Tensor) -> None:
        """Writes the rows of the step's prompt chunks into `out`, a chunk at a time (prefill)."""
        for seq in meta.prefills:
            out[seq.query_start: seq.query_start + seq.query_len] = self.prefill(q, k, v, kv_cache, seq, layer)
