"""A stand-in for the `flash_attn` package, in Triton: the two calls nano-vllm makes, so that nano-vllm runs on a
machine where flash-attn cannot be installed (the GPU machine has no network, and flash-attn has no wheel for
its torch). `benchmarks/gpu_peers.py` puts this folder first on the peer's PYTHONPATH; kvpilot never imports it.

- `flash_attn_varlen_func`: a variable-length batch of prompts (or prompt chunks after a cached prefix),
  causal with flash-attn 2's bottom-right alignment (query i of a sequence with more keys than queries sees keys
  up to i + num_keys - num_queries). Keys come from `k` / `v` rows, or with `block_table` from a paged cache
  `[num_blocks, page_size, kv_heads, head_dim]`.
- `flash_attn_with_kvcache`: one query token per sequence over its paged cache (decode), split over the
  context (flash-decoding) when the batch alone would leave the GPU idle. The launch depends on tensor shapes
  only, never on values, so CUDA graphs captured with empty contexts (as nano-vllm captures them) replay
  correctly; a sequence with no keys gets zeros.

Both: grouped-query heads, online softmax in float32 with exp2, no dropout, no window, no alibi, no soft-cap
(arguments for those are refused when set). Written for this benchmark: an independent implementation of the
interface, not flash-attn's kernels; `tests/benchmarks/test_flash_attn_shim.py` checks it against float64 math.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_PROGRAMS_PER_SM = 2  # decode splits the context until the grid has about this many programs per SM


@triton.jit
def _key_offsets(k_base, table_ptr, keys, key_mask, stride_kt, stride_kb, PAGE: tl.constexpr,
                 PAGED: tl.constexpr):
    """Element offsets of `keys` (positions in a sequence) from `k_base`: rows of a flat K tensor, or through
    a block-table row into pages (masked keys read page 0, never unmasked)."""
    if PAGED:
        page = tl.load(table_ptr + keys // PAGE, mask=key_mask, other=0).to(tl.int64)
        return k_base + page * stride_kb + (keys % PAGE) * stride_kt
    return k_base + keys.to(tl.int64) * stride_kt


@triton.jit
def _online_softmax(scores, v, m_i, l_i, acc):
    """One key tile into the running (max, sum, output) of each row; scores in log2 units, masked ones -inf."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _varlen_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr, table_ptr, qk_scale,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_kb, stride_vt, stride_vh, stride_vb,
                   stride_ot, stride_oh, stride_bt,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr):
    tile, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    num_queries = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= num_queries:
        return
    k_first = tl.load(cu_k_ptr + seq)
    num_keys = tl.load(cu_k_ptr + seq + 1) - k_first
    shift = num_keys - num_queries  # bottom-right causal alignment
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_queries
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    kv_head = head // GROUP
    k_base = kv_head * stride_kh
    v_base = kv_head * stride_vh
    if not PAGED:
        k_base += k_first.to(tl.int64) * stride_kt
        v_base += k_first.to(tl.int64) * stride_vt
    table = table_ptr + seq.to(tl.int64) * stride_bt
    end = num_keys
    if CAUSAL:
        end = tl.minimum(num_keys, shift + (tile + 1) * BLOCK_M)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        k_offsets = _key_offsets(k_base, table, keys, key_mask, stride_kt, stride_kb, PAGE, PAGED)
        v_offsets = _key_offsets(v_base, table, keys, key_mask, stride_vt, stride_vb, PAGE, PAGED)
        kv_mask = key_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + k_offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k)) * qk_scale
        visible = key_mask[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + shift)
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax(scores, v, m_i, l_i, acc)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, lse_ptr, lens_ptr, table_ptr, qk_scale,
                   stride_qb, stride_qh, stride_kt, stride_kh, stride_kb, stride_ob, stride_oh, stride_bt,
                   keys_per_split, NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """One program per (sequence, KV head, split): the KV head's GROUP query heads (padded to BLOCK_G rows of
    the dot) over its split of the context. One split writes the output; several write a normalised partial
    output and its log2-sum-exp for `_reduce_kernel`."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_keys = tl.load(lens_ptr + seq)
    first = split * keys_per_split
    end = tl.minimum(num_keys, first + keys_per_split)
    g = tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    table = table_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(first, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        offsets = _key_offsets(kv_head * stride_kh, table, keys, key_mask, stride_kt, stride_kb, PAGE, True)
        kv_mask = key_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.where(key_mask[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_softmax(scores, v, m_i, l_i, acc)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (seq * tl.num_programs(1) * GROUP + heads).to(tl.int64) * NUM_SPLITS + split  # [B, H, S]
        tl.store(part_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _reduce_kernel(out_ptr, part_ptr, lse_ptr, stride_ob, stride_oh, NUM_SPLITS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (sequence, query head): the splits' partial outputs weighted by their sums of
    exponentials; splits with no keys (log-sum -inf) weigh nothing, and no keys at all gives zeros."""
    seq, head = tl.program_id(0), tl.program_id(1)
    row = (seq * tl.num_programs(1) + head).to(tl.int64) * NUM_SPLITS
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + row + s)
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)
    total = tl.sum(weights, 0)
    parts = tl.load(part_ptr + (row + s)[:, None] * BLOCK_D + d[None, :])
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def _refuse(**options) -> None:
    """flash-attn options this stand-in does not implement: an error rather than silently different math."""
    used = [name for name, value in options.items() if _is_set(value)]
    if used:
        raise NotImplementedError(f"the flash_attn stand-in (benchmarks/peers/flash_attn_shim) does not "
                                  f"implement {', '.join(used)}")


def _is_set(value) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, (int, float)):
        return value != 0
    if isinstance(value, tuple):
        return value != (-1, -1)
    return True


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the prompt kernel: smaller tiles for float32 and wide heads."""
    if dtype == torch.float32 or head_dim > 128:
        return 32, 32, 4
    return 128, 64, 8


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """q [total_q, heads, D]; k, v [total_k, kv_heads, D], or with `block_table` [num_pages, page, kv_heads, D]
    pages (cu_seqlens_k then counts each sequence's keys, cached prefix included). Returns [total_q, heads, D]."""
    _refuse(dropout_p=dropout_p, window_size=tuple(window_size), softcap=softcap, alibi_slopes=alibi_slopes,
            return_attn_probs=return_attn_probs)
    q, k, v = (_inner_contiguous(t) for t in (q, k, v))
    heads, head_dim = q.shape[-2], q.shape[-1]
    kv_heads = k.shape[-2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    paged = block_table is not None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens_q.numel() - 1
    block_m, block_n, warps = _tiles(head_dim, q.dtype)
    page = k.shape[1] if paged else 1
    if paged and page % block_n:
        block_n = math.gcd(page, block_n)
    table = block_table if paged else cu_seqlens_q  # any int32 tensor: never read unpaged
    scale = (softmax_scale if softmax_scale is not None else head_dim ** -0.5) * LOG2E
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, heads)
    _varlen_kernel[grid](q, k, v, out, cu_seqlens_q, cu_seqlens_k, table, scale,
                         q.stride(0), q.stride(1), k.stride(-3), k.stride(-2), k.stride(0) if paged else 0,
                         v.stride(-3), v.stride(-2), v.stride(0) if paged else 0, out.stride(0), out.stride(1),
                         table.stride(0) if paged else 0,
                         GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                         BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page, PAGED=paged, CAUSAL=causal,
                         num_warps=warps)
    return out


def decode_splits(batch: int, kv_heads: int, max_keys: int, num_sms: int, block_n: int) -> int:
    """How many parts each sequence's context is split into (a power of two): enough that the grid has
    about MIN_PROGRAMS_PER_SM programs per SM, none shorter than one key tile. From shapes only."""
    want = triton.cdiv(MIN_PROGRAMS_PER_SM * num_sms, max(1, batch * kv_heads))
    most = max(1, max_keys // block_n)
    return min(triton.next_power_of_2(want), triton.next_power_of_2(most + 1) // 2, 64)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: still exercise the split path


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """q [batch, 1, heads, D] over pages [num_pages, page, kv_heads, D] through `block_table` [batch, pages],
    `cache_seqlens` [batch] keys each. Returns [batch, 1, heads, D]."""
    _refuse(k=k, v=v, rotary_cos=rotary_cos, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
            window_size=tuple(window_size), softcap=softcap, alibi_slopes=alibi_slopes,
            return_softmax_lse=return_softmax_lse)
    if block_table is None or cache_seqlens is None:
        raise NotImplementedError("the flash_attn stand-in reads paged caches only: pass block_table and "
                                  "cache_seqlens")
    if q.shape[1] != 1:
        raise NotImplementedError(f"the flash_attn stand-in decodes one query token per sequence, not {q.shape[1]}")
    batch, _, heads, head_dim = q.shape
    kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    q2 = _inner_contiguous(q[:, 0])
    out = torch.empty((batch, heads, head_dim), dtype=q.dtype, device=q.device)
    block_n = 64 if head_dim <= 128 and q.dtype != torch.float32 else 32
    block_n = math.gcd(page, block_n)
    block_d = triton.next_power_of_2(head_dim)
    splits = decode_splits(batch, kv_heads, block_table.shape[1] * page, _num_sms(q.device), block_n)
    keys_per_split = triton.cdiv(triton.cdiv(block_table.shape[1] * page, splits), block_n) * block_n
    part = torch.empty((batch, heads, splits, block_d), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    scale = (softmax_scale if softmax_scale is not None else head_dim ** -0.5) * LOG2E
    _decode_kernel[(batch, kv_heads, splits)](
        q2, k_cache, v_cache, out, part, lse, cache_seqlens, block_table, scale,
        q2.stride(0), q2.stride(1), k_cache.stride(1), k_cache.stride(2), k_cache.stride(0), out.stride(0),
        out.stride(1), block_table.stride(0), keys_per_split, NUM_SPLITS=splits, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        PAGE=page, num_warps=4)
    if splits > 1:
        _reduce_kernel[(batch, heads)](out, part, lse, out.stride(0), out.stride(1), NUM_SPLITS=splits,
                                       HEAD_DIM=head_dim, BLOCK_D=block_d)
    return out.unsqueeze(1)
