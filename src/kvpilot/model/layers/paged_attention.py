"""Attention ops over a paged KV cache, used by the torch and cpu backends (kvpilot.model.attention).

KV cache layout per layer: [2, kv_heads, num_blocks, block_size, head_dim] (K then V), head-major so that
gathering a sequence's blocks yields [kv_heads, tokens, head_dim], the layout matmuls want, with one
row copy and no transpose. New K/V are written through the slot mapping (slot = block * block_size +
offset); each sequence reads its keys through its block table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.model.attention.metadata import DecodeBatch, PrefillSeq, make_key_bias
from kvpilot.model.kv_dtype import FP8_DTYPES
from kvpilot.model.layers.cpu_decode_kernel import get_kernel, kernel_applies


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores k, v ([T, kv_heads, head_dim]) at their slots of this layer's cache (rounded to its dtype)."""
    two, kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    flat = kv_cache.view(two, kv_heads, num_blocks * block_size, head_dim)
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if kv_cache.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernel: copy the same bytes as uint8
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(1, slot_mapping, k.transpose(0, 1))
    flat[1].index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[kv_heads, num_blocks, block_size, D] cache, flat block ids [n] -> [kv_heads, n * block_size, D].

    One contiguous row copy per (head, block): index_select on a 3-D view is a plain memcpy loop, several
    times faster than advanced indexing.
    """
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    rows = cache.view(kv_heads, num_blocks, block_size * head_dim).index_select(1, block_ids)
    return rows.view(kv_heads, -1, head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, seq: PrefillSeq,
             scale: float) -> torch.Tensor:
    rows = slice(seq.query_start, seq.query_start + seq.query_len)
    if seq.mask is None:
        keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
    else:
        keys = gather_blocks(kv_cache[0], seq.block_ids)[:, : seq.context_len].to(q.dtype)
        values = gather_blocks(kv_cache[1], seq.block_ids)[:, : seq.context_len].to(q.dtype)
    out = F.scaled_dot_product_attention(
        q[rows].transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, scale: float,
                  out: torch.Tensor) -> bool:
    """Runs the batch in the C++ kernel (CPU; float32 math, bf16/fp16 queries widened; reads K/V in place),
    writing its rows of `out` ([T, heads, D]); False, with nothing written, when the kernel does not apply."""
    if not kernel_applies(q.device, q.dtype, kv_cache.dtype):
        return False
    queries = batch.rows_of(q)
    widened = queries.dtype != torch.float32
    if widened:
        queries = queries.float()
    elif queries.stride(-1) != 1 or queries.stride(-2) != queries.shape[-1]:
        queries = queries.contiguous()
    # consecutive float32 rows: the kernel writes straight into `out`; otherwise into a buffer copied after
    direct = batch.row_range is not None and not widened
    target = batch.rows_of(out) if direct else torch.empty_like(queries)
    get_kernel().paged_decode(target, queries, kv_cache[0], kv_cache[1], batch.block_tables, batch.context_lens,
                              scale)
    if not direct:
        if batch.row_range is not None:
            batch.rows_of(out).copy_(target)
        else:
            out[batch.token_rows] = target.to(out.dtype)
    return True


def decode_torch(q: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, scale: float) -> torch.Tensor:
    """Any device and dtype: gather the group's blocks, then two bmm and one softmax."""
    num_seqs, max_blocks = batch.block_tables.shape
    kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
    group = q.shape[1] // kv_heads
    # [B, H, D] -> [kvH * B, G, D]: query heads grouped under their KV head, KV head outermost
    queries = batch.rows_of(q).reshape(num_seqs, kv_heads, group, head_dim).transpose(0, 1)
    queries = queries.reshape(kv_heads * num_seqs, group, head_dim)
    flat_ids = batch.block_tables.reshape(-1)
    keys = gather_blocks(kv_cache[0], flat_ids).view(kv_heads * num_seqs, -1, head_dim).to(q.dtype)  # [kvH*B, L, D]
    values = gather_blocks(kv_cache[1], flat_ids).view(kv_heads * num_seqs, -1, head_dim).to(q.dtype)
    scores = torch.bmm(queries, keys.transpose(1, 2)).float() * scale  # [kvH*B, G, L]
    bias = batch.key_bias if batch.key_bias is not None else make_key_bias(batch.context_lens, keys.shape[1])
    scores = scores.view(kv_heads, num_seqs, group, -1) + bias[:, 0][None]
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(kv_heads * num_seqs, group, -1)
    out = torch.bmm(probs, values).view(kv_heads, num_seqs, group, head_dim)  # [kvH, B, G, D]
    return out.transpose(0, 1).reshape(num_seqs, kv_heads * group, head_dim)
