"""Prefill/extend attention over the paged cache, in Triton: a variable-length batch of prompt chunks, each
attending to its sequence's earlier cached tokens (prefix-cache hits, earlier chunks) and causally to its
own new tokens.

One program per (prefill sequence, tile of BLOCK_M queries, query head). Keys come from two places: the
cached prefix (positions < start) read in place through the block table, then the step's own new K/V read
straight from the k/v tensors in full precision (as the torch backend does for a fresh prompt; with an
fp8 cache only the prefix is rounded). Online softmax in float32, exp2 with the scale folded in. GQA maps
query head h to KV head h // group.

Layer variants (LayerAttention): with a sliding window a query tile starts at the first key its first query
sees (the cached prefix from there, then its own new keys), masking each row's window, so no block wholly
before the window is read; a soft-cap maps the scores before the mask; sinks start each row's softmax as a
term of value zero (m = sink, l = 1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.model.attention.base import LayerAttention, as_layer_attention
from kvpilot.model.attention.triton_decode import LOG2E, dot_precision, paged_offsets, softcap_log2, wide_offsets


def prefill_tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M queries, BLOCK_N keys, num_warps, num_stages). From sm_90 compiles (cuobjdump resource
    usage, triton 3.7) and, at head dim 128 in bf16, timings on an H100 (attention_kernels.py: 128 x 128 beat
    128 x 32 on long prompts and long prefixes, though its compile spills a little; docs/benchmark-log.md,
    "Figures moved out of the code"). Head dim 64: 128 x 64 (8 warps, 224
    registers, untimed); head dim 256 and float32 (IEEE dots) spill at every size tried, least at 32 x 32
    (and 32 x 16 for float32 at 256)."""
    if dtype == torch.float32:
        return (32, 32, 4, 2) if head_dim <= 128 else (32, 16, 4, 2)
    if head_dim <= 64:
        return 128, 64, 8, 3
    if head_dim <= 128:
        return 128, 128, 8, 3
    return 32, 32, 4, 2


@triton.jit
def _online_softmax_step(q, k, v, m_i, l_i, acc, valid, qk_scale, cap_log2, PRECISION: tl.constexpr,
                         MASKED: tl.constexpr = True, SOFTCAP: tl.constexpr = False, SAFE: tl.constexpr = False):
    """One key tile into the running (max, sum, accumulator): scores in the log2 domain. MASKED=False for a
    tile every query sees whole (below the diagonal, inside the prefix): no select on the scores. SAFE: a row
    may have seen no key yet (a window): its max stays -inf and the exponentials use 0 in its place."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        scores = softcap_log2(scores, cap_log2)
    if MASKED:
        scores = tl.where(valid, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_use = m_new
    if SAFE:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(scores - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _cached_tile(k_cache_ptr, v_cache_ptr, table, head_base, pos, start, d, d_mask, dtype: tl.constexpr, v_scale,
                 stride_cb, stride_ct, block_size, BLOCK_N: tl.constexpr, V_SCALED: tl.constexpr,
                 WIDE: tl.constexpr):
    """Keys pos..pos+BLOCK_N-1 of the cached prefix (those < start), read through the block table."""
    keys = pos + tl.arange(0, BLOCK_N)
    k_mask = keys < start
    offs = paged_offsets(table, head_base, keys, k_mask, stride_cb, stride_ct, block_size, WIDE)
    kv_mask = k_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(dtype)
    v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(dtype)
    if V_SCALED:  # fp8 V scale on the prefix's values, so both parts of the sum share one scale
        v = (v.to(tl.float32) * v_scale).to(dtype)
    return k, v, k_mask


@triton.jit
def _new_tile(k_ptr, v_ptr, first_row, kv_head, pos, end, d, d_mask, dtype: tl.constexpr,
              stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N: tl.constexpr):
    """Keys pos..pos+BLOCK_N-1 (those < end) of the step's own K/V."""
    keys = pos + tl.arange(0, BLOCK_N)
    key_rows = (first_row + keys).to(tl.int64)
    kv_mask = (keys < end)[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + key_rows[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask,
                other=0.0).to(dtype)
    v = tl.load(v_ptr + key_rows[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask,
                other=0.0).to(dtype)
    return k, v, keys


# the block-table width changes from step to step, the window from layer to layer: Triton would compile a
# variant per their value classes
@triton.jit(do_not_specialize=["stride_bt", "window"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr,
                    prefill_seqs_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    stride_ch, stride_cb, stride_ct, stride_bt,
                    qk_scale, cached_qk_scale, v_scale, head_dim, block_size, window, cap_log2,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    V_SCALED: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr,
                    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    i = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    seq = tl.load(prefill_seqs_ptr + i)
    first_row = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - first_row
    if tile * BLOCK_M >= query_len:
        return
    start = tl.load(seq_lens_ptr + seq) - query_len  # tokens cached before this chunk
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
    d = tl.arange(0, BLOCK_D)
    row_mask = rows < query_len
    d_mask = d < head_dim
    token_rows = (first_row + rows).to(tl.int64)
    q = tl.load(q_ptr + token_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    if SINKS:  # the sink starts each row's softmax as a term of value zero
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_base = kv_head * stride_ch
    if WIDE:
        head_base = head_base.to(tl.int64)
    if WINDOW:
        m_i, l_i, acc = _windowed_keys(q, m_i, l_i, acc, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, table, head_base,
                                       first_row, kv_head, start, query_len, tile, rows, d, d_mask, window,
                                       qk_scale, cached_qk_scale, cap_log2, v_scale,
                                       stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, block_size,
                                       BLOCK_M, BLOCK_N, V_SCALED, PRECISION, WIDE, SOFTCAP)
    else:
        m_i, l_i, acc = _causal_keys(q, m_i, l_i, acc, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, table, head_base,
                                     first_row, kv_head, start, query_len, tile, rows, d, d_mask,
                                     qk_scale, cached_qk_scale, cap_log2, v_scale,
                                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, block_size,
                                     BLOCK_M, BLOCK_N, V_SCALED, PRECISION, WIDE, SOFTCAP)

    if WINDOW:  # a padding row past the chunk may have seen no key (l = 0): not stored, but no 0 / 0
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(out_ptr + token_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _causal_keys(q, m_i, l_i, acc, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, table, head_base,
                 first_row, kv_head, start, query_len, tile, rows, d, d_mask,
                 qk_scale, cached_qk_scale, cap_log2, v_scale,
                 stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, block_size,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_SCALED: tl.constexpr, PRECISION: tl.constexpr,
                 WIDE: tl.constexpr, SOFTCAP: tl.constexpr):
    """Every key up to each row's own position: the whole cached prefix, then the chunk's keys causally."""
    # 1. the cached prefix: every key precedes every query, so only the prefix end masks
    # whole tiles first (no masks on the scores), then the partial last tile
    full_prefix = start - start % BLOCK_N
    for pos in range(0, full_prefix, BLOCK_N):
        k, v, k_mask = _cached_tile(k_cache_ptr, v_cache_ptr, table, head_base, pos, start, d, d_mask, q.dtype,
                                    v_scale, stride_cb, stride_ct, block_size, BLOCK_N, V_SCALED, WIDE)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, k_mask[None, :], cached_qk_scale, cap_log2,
                                             PRECISION, MASKED=False, SOFTCAP=SOFTCAP)
    for pos in range(full_prefix, start, BLOCK_N):
        k, v, k_mask = _cached_tile(k_cache_ptr, v_cache_ptr, table, head_base, pos, start, d, d_mask, q.dtype,
                                    v_scale, stride_cb, stride_ct, block_size, BLOCK_N, V_SCALED, WIDE)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, k_mask[None, :], cached_qk_scale, cap_log2,
                                             PRECISION, SOFTCAP=SOFTCAP)

    # 2. the chunk's own tokens, causal: query r sees new keys 0..r. Key tiles wholly before the tile's first
    # query need no mask (BLOCK_M is a multiple of BLOCK_N: the diagonal starts on a key-tile boundary)
    end = tl.minimum(query_len, (tile + 1) * BLOCK_M)
    diagonal = tile * BLOCK_M
    for pos in range(0, diagonal, BLOCK_N):
        k, v, keys = _new_tile(k_ptr, v_ptr, first_row, kv_head, pos, end, d, d_mask, q.dtype,
                               stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, keys[None, :] < end, qk_scale, cap_log2,
                                             PRECISION, MASKED=False, SOFTCAP=SOFTCAP)
    for pos in range(diagonal, end, BLOCK_N):
        k, v, keys = _new_tile(k_ptr, v_ptr, first_row, kv_head, pos, end, d, d_mask, q.dtype,
                               stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N)
        valid = (keys[None, :] < end) & (keys[None, :] <= rows[:, None])
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, valid, qk_scale, cap_log2, PRECISION,
                                             SOFTCAP=SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def _windowed_keys(q, m_i, l_i, acc, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, table, head_base,
                   first_row, kv_head, start, query_len, tile, rows, d, d_mask, window,
                   qk_scale, cached_qk_scale, cap_log2, v_scale,
                   stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, block_size,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_SCALED: tl.constexpr, PRECISION: tl.constexpr,
                   WIDE: tl.constexpr, SOFTCAP: tl.constexpr):
    """Row r (position start + r) sees keys start + r - window < j <= start + r. Key tiles start at the first
    key the tile's first row sees, so nothing before it is loaded; every tile is masked."""
    lo = tl.maximum(start + tile * BLOCK_M - window + 1, 0)  # the first key any row of the tile sees
    oldest = (start + rows - window)[:, None]  # each row sees keys (positions) > oldest
    # 1. the cached prefix from lo on
    for pos in range(lo, start, BLOCK_N):
        k, v, k_mask = _cached_tile(k_cache_ptr, v_cache_ptr, table, head_base, pos, start, d, d_mask, q.dtype,
                                    v_scale, stride_cb, stride_ct, block_size, BLOCK_N, V_SCALED, WIDE)
        valid = k_mask[None, :] & ((pos + tl.arange(0, BLOCK_N))[None, :] > oldest)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, valid, cached_qk_scale, cap_log2, PRECISION,
                                             SOFTCAP=SOFTCAP, SAFE=True)
    # 2. the chunk's own keys (index j = position - start) from the window's start, causal
    end = tl.minimum(query_len, (tile + 1) * BLOCK_M)
    for pos in range(tl.maximum(lo - start, 0), end, BLOCK_N):
        k, v, keys = _new_tile(k_ptr, v_ptr, first_row, kv_head, pos, end, d, d_mask, q.dtype,
                               stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N)
        valid = (keys[None, :] < end) & (keys[None, :] <= rows[:, None]) & ((start + keys)[None, :] > oldest)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, valid, qk_scale, cap_log2, PRECISION,
                                             SOFTCAP=SOFTCAP, SAFE=True)
    return m_i, l_i, acc


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      out: torch.Tensor, prefill_seqs: torch.Tensor, query_start: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int,
                      scale_or_layer: float | LayerAttention, k_scale: float = 1.0, v_scale: float = 1.0,
                      tiles: tuple[int, int, int, int] | None = None) -> None:
    """Writes out's rows of every sequence s in prefill_seqs: query rows query_start[s]..query_start[s+1]-1
    at positions seq_lens[s] - query_len .. seq_lens[s] - 1. q/out: [T, heads, D]; k/v: [T, kv_heads, D]
    (this step's, unit stride in D); kv_cache: [2, kv_heads, num_blocks, block_size, D] holding each
    sequence's earlier tokens; max_query_len >= every prefill's query length (the grid). tiles: (BLOCK_M,
    BLOCK_N, num_warps, num_stages) instead of prefill_tiles' choice (benchmarks/attention_kernels.py sweeps).
    With the layer's window, entries of block_tables wholly before a chunk's first query's window are never read."""
    layer = as_layer_attention(scale_or_layer)
    num_prefills = prefill_seqs.shape[0]
    if num_prefills == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    block_m, block_n, num_warps, num_stages = tiles or prefill_tiles(head_dim, q.dtype)
    if block_m % block_n:
        raise ValueError(f"BLOCK_M ({block_m}) must be a multiple of BLOCK_N ({block_n}): the causal part "
                         "skips masks on whole key tiles before the diagonal")
    grid = (num_prefills, triton.cdiv(max_query_len, block_m), num_heads)
    scale = layer.scale
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, out, layer.sinks if layer.sinks is not None else out, prefill_seqs, query_start,
        seq_lens, block_tables,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * LOG2E, scale * k_scale * LOG2E, v_scale, head_dim, block_size, layer.window, layer.softcap * LOG2E,
        GROUP=num_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), V_SCALED=v_scale != 1.0, PRECISION=dot_precision(q.dtype),
        WIDE=wide_offsets(kv_cache), WINDOW=layer.sliding_window is not None,
        SOFTCAP=layer.logit_softcap is not None, SINKS=layer.sinks is not None,
        num_warps=num_warps, num_stages=num_stages)
