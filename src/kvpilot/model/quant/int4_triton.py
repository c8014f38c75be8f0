"""The 4-bit grouped-weight GEMM for CUDA, in Triton: out = x @ W^T with W an Int4Weight (int4_weight.py),
dequantized tile by tile in the kernel and never held dense.

A program computes a [BLOCK_M, BLOCK_N] tile of the output. Per K step it loads the int32 words of a
[BLOCK_K, BLOCK_N] weight tile (each word holds 8 consecutive inputs of one output: a row of words is read 8
times, from cache), each input's group from g_idx (so act-order checkpoints need no reordering), that group's
scale and zero point, and forms (q - zero) * scale in float32, exact. Float32 activations multiply it in
float32 (input_precision "ieee": no TF32); 16-bit activations round the tile to their dtype first, as the dense
layer would hold the weight, and accumulate in float32 on the tensor cores. The output is rounded once.
Imports triton at module level: reach it through int4_linear.Int4Linear (which checks triton is importable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.model.quant.int4_weight import Int4Weight


@triton.jit
def _int4_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K, stride_x, stride_out,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        tile_ok = k_ok[:, None] & col_ok[None, :]
        words = tl.load(q_ptr + (ks[:, None] // 8).to(tl.int64) * N + cols[None, :], mask=tile_ok, other=0)
        q = (words >> ((ks[:, None] % 8) * 4)) & 0xF
        group = tl.load(g_ptr + ks, mask=k_ok, other=0).to(tl.int64)
        at = group[:, None] * N + cols[None, :]
        scale = tl.load(s_ptr + at, mask=tile_ok, other=0.0)
        zero = tl.load(z_ptr + at, mask=tile_ok, other=0).to(tl.int32)
        w = (q - zero).to(tl.float32) * scale
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def int4_matmul_into(out: torch.Tensor, x: torch.Tensor, w: Int4Weight) -> None:
    """out [M, N] (unit column stride; a column slice of a wider output is fine) = x [M, K] @ W^T; x float32,
    float16 or bfloat16 with unit stride along K, on W's device."""
    m, k = x.shape
    n = w.out_features
    if k != w.in_features or out.shape != (m, n):
        raise ValueError(f"int4 matmul of x {tuple(x.shape)} by a {n} x {w.in_features} weight into "
                         f"{tuple(out.shape)}")
    if m == 0:
        return
    block_m = 16 if m <= 16 else 64  # tl.dot's least; decode batches are small
    block_n, block_k = 64, 64
    precision = "ieee" if x.dtype == torch.float32 else None
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, w.qweight, w.scales, w.zeros, w.g_idx, out, m, n, k, x.stride(0), out.stride(0),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision)
