"""Attention over a paged KV cache, with plain torch ops (the same code runs on CPU and CUDA).

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V). New K/V are
written through the slot mapping; each sequence reads its keys through its block table. Decodes are batched
into one masked matmul (on CPU this is ~5x faster than scaled_dot_product_attention for single queries);
prefills use scaled_dot_product_attention per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.model.layers.attention_metadata import AttentionMetadata, DecodeBatch, PrefillSeq


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores k, v ([T, kv_heads, head_dim]) at their slots of this layer's cache."""
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    flat = kv_cache.view(2, num_slots, kv_cache.shape[3], kv_cache.shape[4])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, seq: PrefillSeq,
             scale: float) -> torch.Tensor:
    rows = slice(seq.query_start, seq.query_start + seq.query_len)
    if seq.mask is None:
        keys, values = k[rows], v[rows]
    else:
        kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        keys = kv_cache[0, seq.block_ids].reshape(-1, kv_heads, head_dim)[: seq.context_len]
        values = kv_cache[1, seq.block_ids].reshape(-1, kv_heads, head_dim)[: seq.context_len]
    out = F.scaled_dot_product_attention(
        q[rows].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
        attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, scale: float) -> torch.Tensor:
    num_seqs = batch.token_rows.shape[0]
    kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    group = q.shape[1] // kv_heads
    queries = q[batch.token_rows].view(num_seqs, kv_heads, group, head_dim)
    keys = kv_cache[0, batch.block_tables].view(num_seqs, -1, kv_heads, head_dim)  # [B, L, kvH, D]
    values = kv_cache[1, batch.block_tables].view(num_seqs, -1, kv_heads, head_dim)
    scores = torch.matmul(queries, keys.permute(0, 2, 3, 1)).float() * scale  # [B, kvH, G, L]
    probs = torch.softmax(scores + batch.key_bias, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values.transpose(1, 2))  # [B, kvH, G, D]
    return out.reshape(num_seqs, kv_heads * group, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, D], k/v: [T, kv_heads, D] for this step's tokens -> [T, heads, D].

    Writes k, v into the cache first, so each query sees its own and all earlier tokens of its sequence.
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    for seq in meta.prefills:
        out[seq.query_start: seq.query_start + seq.query_len] = _prefill(q, k, v, kv_cache, seq, scale)
    if meta.decode is not None:
        out[meta.decode.token_rows] = _decode(q, kv_cache, meta.decode, scale)
    return out
