"""Writes a step's new K/V into the paged cache through the slot mapping: one Triton program per token
stores all its KV heads, K and V, casting to the cache dtype (fp8: divided by the per-tensor scale first).
One launch where torch needs a cast and an index_copy_ for each of K and V. Slots < 0 are skipped
(padding rows of a CUDA-graph batch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ch, stride_cb, stride_ct,
                     inv_k_scale, inv_v_scale, num_kv_heads, head_dim, block_size,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SCALED: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    block = slot // block_size
    offset = slot % block_size
    dst = heads[:, None].to(tl.int64) * stride_ch + block * stride_cb + offset * stride_ct + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if SCALED:
        k = k.to(tl.float32) * inv_k_scale
        v = v.to(tl.float32) * inv_v_scale
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, kv_heads, D] (any row/head strides, unit stride in D); kv_cache: [2, kv_heads, num_blocks,
    block_size, D] contiguous in its last two dims; slot_mapping: [T] int32/int64 (slot = block * block_size
    + offset; < 0 skipped). Stored values are k / k_scale and v / v_scale, rounded to the cache dtype."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    scaled = k_scale != 1.0 or v_scale != 1.0
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        1.0 / k_scale, 1.0 / v_scale, num_kv_heads, head_dim, k_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), SCALED=scaled)
