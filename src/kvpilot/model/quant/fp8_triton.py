"""The fp8 weight-only GEMM for CUDA, in Triton: out = x @ W^T with W an Fp8Weight (fp8_checkpoint.py) of any
scale block shape (128x128 blocks, per-channel, per-tensor), dequantized tile by tile in the kernel.

Used for the layers torch's row-scaled fp8 matmul (quant/fp8.py) cannot take: block scales, and sizes off its
16-wide tiles. Each weight element is widened from e4m3 and multiplied by its block's scale in float32 (exact:
4 significant bits times a float32 scale's 24), then rounded to the activations' dtype for tl.dot (float32
activations stay float32: input_precision "ieee"), accumulated in float32 and rounded once. Activations are not
quantized. Imports triton at module level: reach it through prequant_linear.Fp8BlockLinear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.model.quant.fp8_checkpoint import Fp8Weight


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_s, stride_out,
                     SCALE_ROWS, SCALE_COLS,
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
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None], mask=tile_ok, other=0.0)
        scale = tl.load(s_ptr + (cols[None, :] // SCALE_ROWS).to(tl.int64) * stride_s + ks[:, None] // SCALE_COLS,
                        mask=tile_ok, other=0.0)
        tile = w.to(tl.float32) * scale
        acc = tl.dot(x, tile.to(x.dtype), acc, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_matmul_into(out: torch.Tensor, x: torch.Tensor, w: Fp8Weight) -> None:
    """out [M, N] (unit column stride) = x [M, K] @ W^T; x float32, float16 or bfloat16 with unit stride along
    K, on W's device; W's weight and scale contiguous."""
    m, k = x.shape
    n = w.out_features
    if k != w.in_features or out.shape != (m, n):
        raise ValueError(f"fp8 matmul of x {tuple(x.shape)} by a {n} x {w.in_features} weight into "
                         f"{tuple(out.shape)}")
    if m == 0:
        return
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 64
    precision = "ieee" if x.dtype == torch.float32 else None
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](x, w.weight, w.scale, out, m, n, k, x.stride(0), w.weight.stride(0), w.scale.stride(0),
                           out.stride(0), w.block[0], w.block[1],
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision)
