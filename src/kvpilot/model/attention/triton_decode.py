"""Decode attention over the paged cache with split-KV (flash-decoding), in Triton.

One program per (decode sequence, KV head, split) reads its split of the context in place through the
block table, once for all the query heads that share the KV head (GQA: the group is the M dimension of
the dot, padded to 16), with an online softmax in float32. With one split it writes the final output;
otherwise each split writes a normalised partial output and its log-sum-exp, and a reduce program per
(sequence, head) merges them. Query and key/value dtypes may differ (fp8 K/V are widened as read, their
per-tensor scales folded into the scores and the output).

Layer variants (LayerAttention): with a sliding window a program starts at the window's first key (a split
wholly before it returns at once and the reduce skips it), so no block before the window is read; a soft-cap
maps the scores before the softmax; sinks start the single split's softmax (m = sink, l = 1) or join the
reduce's denominator."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.model.attention.base import LayerAttention, as_layer_attention
from kvpilot.model.attention.triton_split import DecodeSplit

LOG2E = 1.4426950408889634
INT32_OFFSET_LIMIT = 2 ** 31  # caches with fewer elements index K/V with int32 offsets (fewer registers)


def wide_offsets(kv_cache: torch.Tensor) -> bool:
    """Whether element offsets into one layer's cache need 64 bits. With 32-bit offsets the decode kernel
    at head dim 128 fits in 167 registers instead of 206 (sm_90 compile): more programs per SM."""
    return kv_cache.numel() >= INT32_OFFSET_LIMIT


def key_tile(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per loop iteration. Chosen from sm_90 compiles (cuobjdump resource usage, triton 3.7, 4 warps):
    the largest tile with no register spills. 16-bit: 32 keys at head dim 128 (206 registers) and 256 (242),
    where 64 spilled; float32 needs 16 at head dim 256. Not yet timed on a GPU."""
    if dtype == torch.float32:
        return 32 if head_dim <= 64 else 16
    return 64 if head_dim <= 64 else 32


@triton.jit
def softcap_log2(scores, cap_log2):
    """cap * tanh(s / cap) for log2-domain scores (scores = s * log2(e), cap_log2 = cap * log2(e)). tanh(y) =
    sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) for |y| >= 1/4; below, where 1 - e cancels, the odd Taylor
    series to y^9 (remainder < 4e-9): no libdevice call, so the interpreter runs it too."""
    y = scores / cap_log2
    a = tl.abs(y)
    e = tl.exp2(a * -2.8853900817779268)  # exp(-2a)
    large = (1.0 - e) / (1.0 + e)
    y2 = a * a
    small = a * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0 + y2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.25, small, large)
    return tl.where(y < 0, -t, t) * cap_log2


@triton.jit
def window_start(context, window):
    """The first key a decode over keys 0..context-1 sees: context - window with a window (window > 0)."""
    return tl.where(window > 0, tl.maximum(context - window, 0), 0)


@triton.jit
def paged_offsets(table, head_base, keys, k_mask, stride_cb, stride_ct, block_size, WIDE: tl.constexpr):
    """Element offsets of `keys` (token positions) in one layer's K or V cache, read through the block table
    row `table`; masked keys get block 0 (never read unmasked)."""
    block = tl.load(table + keys // block_size, mask=k_mask, other=0)
    if WIDE:
        block = block.to(tl.int64)
    return head_base + block * stride_cb + (keys % block_size) * stride_ct


# the block-table width changes from step to step, the window from layer to layer: Triton would compile a
# variant per their value classes
@triton.jit(do_not_specialize=["stride_bt", "window"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr,
                         decode_seqs_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
                         stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_ch, stride_cb, stride_ct, stride_bt,
                         stride_pb, stride_ph, stride_ps,
                         qk_scale, v_scale, partition_size, head_dim, block_size, window, cap_log2,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, PRECISION: tl.constexpr,
                         WIDE: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(decode_seqs_ptr + b)
    context = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    first_key = window_start(context, window)
    if (start >= context) | (start + partition_size <= first_key):
        return
    end = tl.minimum(start + partition_size, context)
    row = tl.load(query_start_ptr + seq).to(tl.int64)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < head_dim
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_base = kv_head * stride_ch
    if WIDE:
        head_base = head_base.to(tl.int64)

    if SINKS and SINGLE:  # the sink starts the softmax as a term of value zero (split: the reduce adds it)
        m_i = tl.load(sinks_ptr + heads, mask=g_mask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(g_mask, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for pos in range(tl.maximum(start, first_key), end, BLOCK_N):
        keys = pos + tl.arange(0, BLOCK_N)
        k_mask = keys < end
        offs = paged_offsets(table, head_base, keys, k_mask, stride_cb, stride_ct, block_size, WIDE)
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 domain
        if SOFTCAP:
            scores = softcap_log2(scores, cap_log2)
        scores = tl.where(k_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc * (v_scale / l_i)[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], out, mask=store_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit(do_not_specialize=["window"])
def _decode_reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, decode_seqs_ptr, query_start_ptr,
                          seq_lens_ptr, stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, partition_size,
                          head_dim, window, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(decode_seqs_ptr + b)
    context = tl.load(seq_lens_ptr + seq)
    row = tl.load(query_start_ptr + seq).to(tl.int64)
    num_splits = tl.cdiv(context, partition_size)
    first_split = window_start(context, window) // partition_size  # earlier splits returned without writing
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = (s < num_splits) & (s >= first_split)
    part = b.to(tl.int64) * stride_pb + head * stride_ph + s * stride_ps
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    if SINKS:  # a logit with no value: in the max and the denominator only
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weights = tl.exp2(lse - top)
    weights = tl.where(s_mask, weights, 0.0)
    parts = tl.load(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0)
    total = tl.sum(weights, 0)
    if SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(parts * weights[:, None], 0) / total
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, decode_seqs: torch.Tensor,
                     query_start: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                     split: DecodeSplit, scale_or_layer: float | LayerAttention, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> None:
    """Writes out[query_start[s]] for every s in decode_seqs: that token attends to keys 0..seq_lens[s]-1
    of sequence s (the last `window` of them with a window), read through block_tables[s] (entries past the
    context, or wholly before the window, are never read). q/out: [T, heads, D], unit stride in D; kv_cache:
    [2, kv_heads, num_blocks, block_size, D]."""
    layer = as_layer_attention(scale_or_layer)
    num_decodes = decode_seqs.shape[0]
    if num_decodes == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    if split.single:
        part_out = part_lse = out  # unused
        part_strides = (0, 0, 0)
    else:
        part_lse = torch.empty((num_decodes, num_heads, split.num_splits), dtype=torch.float32, device=q.device)
        part_out = torch.empty((num_decodes, num_heads, split.num_splits, block_d), dtype=torch.float32,
                               device=q.device)
        part_strides = part_lse.stride()
    sinks = layer.sinks if layer.sinks is not None else part_lse  # a placeholder pointer when none (not read)
    _decode_split_kernel[(num_decodes, num_kv_heads, split.num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, sinks, decode_seqs, query_start, seq_lens, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), *part_strides,
        layer.scale * k_scale * LOG2E, v_scale, split.partition_size, head_dim, block_size, layer.window,
        layer.softcap * LOG2E, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=min(key_tile(head_dim, q.dtype), split.partition_size), SINGLE=split.single,
        PRECISION=dot_precision(q.dtype), WIDE=wide_offsets(kv_cache), SOFTCAP=layer.logit_softcap is not None,
        SINKS=layer.sinks is not None)
    if not split.single:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            out, part_out, part_lse, sinks, decode_seqs, query_start, seq_lens, out.stride(0), out.stride(1),
            *part_strides, split.partition_size, head_dim, layer.window,
            BLOCK_S=triton.next_power_of_2(split.num_splits), BLOCK_D=block_d, SINKS=layer.sinks is not None)


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 dots in full IEEE precision (Triton's default is tf32): fp32 greedy must match HF token for
    token. None (the default) for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else None
