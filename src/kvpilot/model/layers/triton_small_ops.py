"""Fused small ops for CUDA, in Triton: RMSNorm, rotary embedding, SiLU-and-mul and fp8 activation
quantization, one kernel each where torch launches six, six, two and seven, and q/k RMSNorm with rotary in one
kernel for models with q/k norms (Qwen3: four launches a layer become one), and a residual add with the
RMSNorm after it (two launches a layer fewer). A small-batch decode step is otherwise some 1,500
kernels of a microsecond or two, and they, not the weights, set its time (docs/benchmark-log.md, "Figures moved
out of the code").

RMSNorm and SiLU-and-mul round to the activation dtype where the torch ops do (kvpilot.model.layers.norm,
llama.MLP); rotary computes in float32 and rounds once. Imports triton at module level: reach it through
gpu_small_ops.small_ops_for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_xt, stride_xh, num_heads, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # token * num_heads + head
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + (row // num_heads) * stride_xt + (row % num_heads) * stride_xh + cols, mask=mask,
                other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty)  # torch: (x32 * rsqrt).to(dtype), then weight * it
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x: [T, D] or [T, heads, D] (unit stride in D, any other strides,
    so q/k views of the fused projection need no copy). Returns a contiguous tensor of x's shape."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_cols = x.shape[-1]
    num_heads = x.shape[1] if x.dim() == 3 else 1
    stride_h = x.stride(1) if x.dim() == 3 else 0
    if out.numel():
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(x.shape[0] * num_heads,)](x, weight, out, x.stride(0), stride_h, num_heads, n_cols, eps,
                                                    BLOCK=block, num_warps=_norm_warps(block))
    return out


def _norm_warps(block: int) -> int:
    """Warps of a norm's row (one value for both norm kernels: the reduction's order follows it)."""
    return min(max(block // 256, 1), 8)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_r, n_cols, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + r).to(sum_ptr.dtype.element_ty)  # torch's add: in float32, rounded to the dtype
    tl.store(sum_ptr + row * n_cols + cols, total, mask=mask)
    total = total.to(tl.float32)  # from here _rms_norm_kernel's steps on the rounded sum
    rstd = 1.0 / tl.sqrt(tl.sum(total * total, 0) / n_cols + eps)
    normed = (total * rstd).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm of it) for [T, D] rows (unit stride in D): the residual add and the next norm of
    a decoder layer in one launch, bit for bit torch's add then rms_norm."""
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_cols = x.shape[-1]
    if out.numel():
        block = triton.next_power_of_2(n_cols)
        _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, total, out, x.stride(0), residual.stride(0), n_cols,
                                            eps, BLOCK=block, num_warps=_norm_warps(block))
    return total, out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh, half,
                 BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    mask = d < half
    base = x_ptr + token * stride_xt + head * stride_xh
    x1 = tl.load(base + d, mask=mask, other=0.0)
    x2 = tl.load(base + half + d, mask=mask, other=0.0)
    cos1 = tl.load(cos_ptr + token * stride_ct + d, mask=mask, other=0.0)
    cos2 = tl.load(cos_ptr + token * stride_ct + half + d, mask=mask, other=0.0)
    sin1 = tl.load(sin_ptr + token * stride_ct + d, mask=mask, other=0.0)
    sin2 = tl.load(sin_ptr + token * stride_ct + half + d, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    # x * cos + cat(-x2, x1) * sin in float32, rounded once (torch rounds each product and the sum: compiled
    # for sm_90, rounding the products here still differed from torch's by an ulp now and then)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    out = out_ptr + token * stride_ot + head * stride_oh
    tl.store(out + d, (x1 * cos1.to(tl.float32) - x2 * sin1.to(tl.float32)).to(dtype), mask=mask)
    tl.store(out + half + d, (x2 * cos2.to(tl.float32) + x1 * sin2.to(tl.float32)).to(dtype), mask=mask)


def _token_tables(cos: torch.Tensor, sin: torch.Tensor, num_tokens: int,
                  head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin as [T, D] rows of unit stride sharing one token stride (the kernels take one)."""
    cos, sin = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    if num_tokens and (cos.stride(1) != 1 or sin.stride() != cos.stride()):
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (unit stride in D, any token/head strides); cos, sin: [T, 1, D] in x's dtype."""
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    cos, sin = _token_tables(cos, sin, num_tokens, head_dim)
    if num_tokens:
        half = head_dim // 2
        _rope_kernel[(num_tokens, num_heads)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0),
                                             out.stride(0), out.stride(1), half, BLOCK=triton.next_power_of_2(half))
    return out


@triton.jit
def _qk_norm_rope_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct,
                         num_q_heads, n_cols, half, eps, BLOCK: tl.constexpr, HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = x_ptr + token * stride_xt + head * stride_xh
    # The row's inverse RMS exactly as _rms_norm_kernel computes it (the same reduction over BLOCK lanes) ...
    cols = tl.arange(0, BLOCK)
    row = tl.load(base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(row * row, 0) / n_cols + eps)
    # ... then its two halves normed and weighted, rounded where _rms_norm_kernel rounds, and rotated as
    # _rope_kernel does: bit for bit the two kernels one after the other.
    d = tl.arange(0, HALF)
    mask = d < half
    # q heads take q_norm's weight, k heads k_norm's (masked loads: one of the two is 0)
    heads = tl.zeros([HALF], dtype=tl.int32) + head
    q_mask = mask & (heads < num_q_heads)
    k_mask = mask & (heads >= num_q_heads)
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + d, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(qw_ptr + d, mask=q_mask, other=0.0).to(tl.float32) + \
        tl.load(kw_ptr + d, mask=k_mask, other=0.0).to(tl.float32)
    w2 = tl.load(qw_ptr + half + d, mask=q_mask, other=0.0).to(tl.float32) + \
        tl.load(kw_ptr + half + d, mask=k_mask, other=0.0).to(tl.float32)
    y1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    cos1 = tl.load(cos_ptr + token * stride_ct + d, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_ct + half + d, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * stride_ct + d, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_ct + half + d, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + (token * tl.num_programs(1) + head) * n_cols
    tl.store(out + d, (y1 * cos1 - y2 * sin1).to(dtype), mask=mask)
    tl.store(out + half + d, (y2 * cos2 + y1 * sin2).to(dtype), mask=mask)


def qk_norm_rotary(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, num_q_heads: int,
                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk: [T, q heads + k heads, D] (unit stride in D, any token/head strides: a view of the fused
    projection); each head RMS-normed with q_weight (the first num_q_heads) or k_weight, then rotated by cos,
    sin ([T, 1, D], qk's dtype). Returns a contiguous [T, heads, D]: rotary(rms_norm(...)) in one launch."""
    num_tokens, num_heads, head_dim = qk.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=qk.dtype, device=qk.device)
    cos, sin = _token_tables(cos, sin, num_tokens, head_dim)
    if num_tokens:
        half = head_dim // 2
        _qk_norm_rope_kernel[(num_tokens, num_heads)](qk, q_weight, k_weight, cos, sin, out, qk.stride(0),
                                                     qk.stride(1), cos.stride(0), num_q_heads, head_dim, half, eps,
                                                     BLOCK=triton.next_power_of_2(head_dim),
                                                     HALF=triton.next_power_of_2(half))
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # torch: silu(gate) in the dtype, then * up
    tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up, unit stride in the last dimension) -> silu(gate) * up, [T, I]."""
    num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        block = min(1024, triton.next_power_of_2(width))
        _silu_mul_kernel[(num_rows, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                width, BLOCK=block)
    return out


@triton.jit
def _quantize_rows_fp8_kernel(x_ptr, fp8_out_ptr, scales_ptr, stride_x, stride_q, width, fp8_max, min_scale,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, width, BLOCK):  # pass 1: the row's largest magnitude
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / fp8_max, min_scale)
    tl.store(scales_ptr + row, scale)
    for start in range(0, width, BLOCK):  # pass 2: scaled, clamped (e4m3 has no infinity), cast
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
        tl.store(fp8_out_ptr + row * stride_q + cols, q.to(fp8_out_ptr.dtype.element_ty), mask=cols < width)


def quantize_rows_fp8(x: torch.Tensor, fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] (unit stride in K) -> (e4m3 [R, K], float32 scales [R, 1]), x ~= q * scale per row: what
    kvpilot.model.quant.fp8.quantize_rows computes in ~7 torch kernels, in one (a decode step of an fp8
    model ran ~800 of them at batch 1)."""
    num_rows, width = x.shape
    q = torch.empty((num_rows, width), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows:
        block = min(4096, triton.next_power_of_2(width))
        _quantize_rows_fp8_kernel[(num_rows,)](x, q, scale, x.stride(0), q.stride(0), width, fp8_max, min_scale,
                                               BLOCK=block, num_warps=min(max(block // 512, 1), 8))
    return q, scale
