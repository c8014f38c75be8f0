"""Attention ops over a paged KV cache, used by the torch and cpu backends (kvpilot.model.attention).

KV cache layout per layer: [2, kv_heads, num_blocks, block_size, head_dim] (K then V), head-major so that
gathering a sequence's blocks yields [kv_heads, tokens, head_dim], the layout matmuls want, with one
row copy and no transpose. New K/V are written through the slot mapping (slot = block * block_size +
offset); each sequence reads its keys through its block table.

Layer variants (LayerAttention: sliding window, logit soft-cap, sinks) follow HF transformers exactly. With a
sliding window, no block wholly outside the window of every query of the step is read (its table entry may name
a block the KV manager gave to another sequence, or a null block).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.model.attention.base import LayerAttention, as_layer_attention
from kvpilot.model.attention.metadata import DecodeBatch, PrefillSeq, make_key_bias
from kvpilot.model.kv_dtype import FP8_DTYPES
from kvpilot.model.layers.cpu_decode_kernel import get_kernel, kernel_applies

# float32 scores per slice of a variant prefill's queries (heads x queries x keys): 128 MiB
SCORE_BUDGET = 2 ** 25
NO_SINKS = torch.empty(0, dtype=torch.float32)  # the C++ kernels' spelling of "no sinks"


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
                      scale_or_layer: float | LayerAttention) -> torch.Tensor:
    """The sequence's rows of the output ([query_len, heads, D]); its K/V are already in kv_cache."""
    layer = as_layer_attention(scale_or_layer)
    if layer.features:
        return prefill_variant(q, k, v, kv_cache, seq, layer)
    rows = slice(seq.query_start, seq.query_start + seq.query_len)
    if seq.mask is None:
        keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
    else:
        keys = gather_blocks(kv_cache[0], seq.block_ids)[:, : seq.context_len].to(q.dtype)
        values = gather_blocks(kv_cache[1], seq.block_ids)[:, : seq.context_len].to(q.dtype)
    out = F.scaled_dot_product_attention(
        q[rows].transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=seq.mask, is_causal=seq.mask is None, scale=layer.scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def prefill_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, seq: PrefillSeq,
                    layer: LayerAttention) -> torch.Tensor:
    """prefill_attention for a layer with a window, soft-cap or sinks: queries in slices whose scores fit
    SCORE_BUDGET, each over just the keys its queries see. With a window, cached blocks wholly before the first
    query's window are never gathered (the KV manager may have reused them)."""
    rows = slice(seq.query_start, seq.query_start + seq.query_len)
    start = seq.context_len - seq.query_len
    window = layer.window
    block_size = kv_cache.shape[3]
    if seq.mask is None:  # a fresh prompt: its own K/V are all its keys, in full precision
        first_key, keys, values = 0, k[rows].transpose(0, 1), v[rows].transpose(0, 1)
    else:
        first_key = max(0, start - window + 1) if window else 0
        first_block = first_key // block_size
        skip = first_key - first_block * block_size
        block_ids = seq.block_ids[first_block:]
        keys = gather_blocks(kv_cache[0], block_ids)[:, skip: seq.context_len - first_block * block_size]
        values = gather_blocks(kv_cache[1], block_ids)[:, skip: seq.context_len - first_block * block_size]
    queries = q[rows]
    out = torch.empty_like(queries)
    step = max(1, SCORE_BUDGET // (q.shape[1] * keys.shape[1]))
    for a in range(0, seq.query_len, step):
        b = min(a + step, seq.query_len)
        lo = max(first_key, start + a - window + 1) if window else first_key
        out[a:b] = dense_attention(queries[a:b], keys[:, lo - first_key: start + b - first_key],
                                   values[:, lo - first_key: start + b - first_key], start + a, lo, layer)
    return out


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_query: int, first_key: int,
                    layer: LayerAttention) -> torch.Tensor:
    """q [n, heads, D] at positions first_query.. over keys/values [kv_heads, L, D] at positions first_key..:
    [n, heads, D], with the layer's soft-cap, causal (and window) mask and sinks; scores in float32."""
    n, heads, head_dim = q.shape
    kv_heads, num_keys = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    queries = q.transpose(0, 1).reshape(kv_heads, group * n, head_dim)  # head kv * group + g, then query
    scores = torch.bmm(queries, keys.to(q.dtype).transpose(1, 2)).float() * layer.scale
    scores = softcap_scores(scores, layer).view(kv_heads, group, n, num_keys)
    query_pos = torch.arange(first_query, first_query + n, device=q.device)[:, None]
    key_pos = torch.arange(first_key, first_key + num_keys, device=q.device)[None, :]
    visible = key_pos <= query_pos
    if layer.sliding_window is not None:
        visible &= key_pos > query_pos - layer.sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    sinks = None if layer.sinks is None else layer.sinks.view(kv_heads, group, 1, 1)
    probs = softmax_with_sinks(scores, sinks).to(values.dtype).view(kv_heads, group * n, num_keys)
    out = torch.bmm(probs, values.to(probs.dtype)).view(heads, n, head_dim)
    return out.transpose(0, 1).to(q.dtype)


def softcap_scores(scores: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
    """cap * tanh(scores / cap) (Gemma 2), or scores as they are without a cap."""
    if layer.logit_softcap is None:
        return scores
    return torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; `sinks` (broadcast to scores[..., :1]) join each denominator with no value
    (gpt-oss's learned per-head logit)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, scale_or_layer: float | LayerAttention,
                  out: torch.Tensor) -> bool:
    """Runs the batch in the C++ kernel (CPU; float32 math, bf16/fp16 queries widened; reads K/V in place; a
    window's blocks only), writing its rows of `out` ([T, heads, D]); False, with nothing written, when the
    kernel does not apply."""
    if not kernel_applies(q.device, q.dtype, kv_cache.dtype):
        return False
    layer = as_layer_attention(scale_or_layer)
    queries = batch.rows_of(q)
    widened = queries.dtype != torch.float32
    if widened:
        queries = queries.float()
    elif queries.stride(-1) != 1 or queries.stride(-2) != queries.shape[-1]:
        queries = queries.contiguous()
    # consecutive float32 rows: the kernel writes straight into `out`; otherwise into a buffer copied after
    direct = batch.row_range is not None and not widened
    target = batch.rows_of(out) if direct else torch.empty_like(queries)
    sinks = layer.sinks.contiguous() if layer.sinks is not None else NO_SINKS
    get_kernel().paged_decode_variant(target, queries, kv_cache[0], kv_cache[1], batch.block_tables,
                                      batch.context_lens, layer.scale, layer.window, layer.softcap, sinks)
    if not direct:
        if batch.row_range is not None:
            batch.rows_of(out).copy_(target)
        else:
            out[batch.token_rows] = target.to(out.dtype)
    return True


def decode_torch(q: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch,
                 scale_or_layer: float | LayerAttention) -> torch.Tensor:
    """Any device and dtype: gather the group's blocks (with a window, only the window's), then two bmm and
    one softmax."""
    layer = as_layer_attention(scale_or_layer)
    num_seqs = batch.block_tables.shape[0]
    kv_heads, block_size, head_dim = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
    group = q.shape[1] // kv_heads
    # [B, H, D] -> [kvH * B, G, D]: query heads grouped under their KV head, KV head outermost
    queries = batch.rows_of(q).reshape(num_seqs, kv_heads, group, head_dim).transpose(0, 1)
    queries = queries.reshape(kv_heads * num_seqs, group, head_dim)
    tables, key_pos = window_tables(batch, block_size, layer.window)
    flat_ids = tables.reshape(-1)
    keys = gather_blocks(kv_cache[0], flat_ids).view(kv_heads * num_seqs, -1, head_dim).to(q.dtype)  # [kvH*B, L, D]
    values = gather_blocks(kv_cache[1], flat_ids).view(kv_heads * num_seqs, -1, head_dim).to(q.dtype)
    scores = torch.bmm(queries, keys.transpose(1, 2)).float() * layer.scale  # [kvH*B, G, L]
    scores = softcap_scores(scores, layer).view(kv_heads, num_seqs, group, -1)
    if key_pos is None:
        bias = batch.key_bias if batch.key_bias is not None else make_key_bias(batch.context_lens, keys.shape[1])
        scores = scores + bias[:, 0][None]
    else:  # a select, not a bias, and zeroed values: nothing of a key outside the window gets through, not a NaN
        ctx = batch.context_lens[:, None]
        visible = (key_pos < ctx) & (key_pos >= ctx - layer.window)  # [B, L]
        scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
        values = values.view(kv_heads, num_seqs, -1, head_dim).masked_fill(~visible[None, :, :, None], 0)
    sinks = None if layer.sinks is None else layer.sinks.view(kv_heads, 1, group, 1)
    probs = softmax_with_sinks(scores, sinks).to(values.dtype).view(kv_heads * num_seqs, group, -1)
    out = torch.bmm(probs, values.view(kv_heads * num_seqs, -1, head_dim)).view(kv_heads, num_seqs, group, head_dim)
    return out.transpose(0, 1).reshape(num_seqs, kv_heads * group, head_dim)


def window_tables(batch: DecodeBatch, block_size: int, window: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(block table columns to gather [B, n], key positions of the gathered rows [B, n * block_size] or None).
    No window: the whole tables, None. A window: for each sequence the n columns from its window's first block
    (n = the most blocks W keys can touch), so blocks wholly before the window are never gathered; columns past
    the table are clamped to it (their keys lie past the context: masked)."""
    tables = batch.block_tables
    max_blocks = tables.shape[1]
    if not window:
        return tables, None
    num_cols = min(max_blocks, (window + 2 * block_size - 2) // block_size)
    first_key = (batch.context_lens - window).clamp(min=0)
    first_col = (first_key // block_size).clamp(max=max_blocks - num_cols)
    cols = first_col[:, None] + torch.arange(num_cols, device=tables.device)[None, :]
    key_pos = (first_col * block_size)[:, None] + torch.arange(num_cols * block_size, device=tables.device)[None, :]
    return tables.gather(1, cols), key_pos
