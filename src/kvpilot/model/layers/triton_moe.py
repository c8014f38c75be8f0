"""Fused experts for CUDA, in Triton: the (token, expert) pairs grouped by expert in blocks, then one grouped
GEMM for gate/up with SiLU-and-mul, one for down with the router weight, and a sum over each token's k rows.

Grouping (`align_pairs`, torch ops on the device, no host sync, so a CUDA graph captures it): the pairs are
sorted by expert, and each expert's run is padded to a multiple of BLOCK_M with the sentinel pair id P (the
number of pairs), so that every block of BLOCK_M sorted rows belongs to one expert. The grid is sized for the
most blocks any routing can need (P // BLOCK_M + min(E, P)); blocks past the last expert's run see expert -1
and exit. A program multiplies its block's rows (gathered from their tokens) by one tile of its expert's
weights: a batch-1 step reads only the k chosen experts' weights.

The intermediate activations are rounded to the activation dtype as the torch path rounds them (gate and up,
then SiLU, then the product); each pair's weighted down row is stored in the activation dtype (a [T*k, H]
buffer: float32 ones would double a long prompt's) and a token's k rows are summed in float32.
Variant experts (gpt-oss, layers/moe_variants.py): a bias per expert output, added to each GEMM's rounded result
as the torch path adds it, and the clamped SwiGLU in place of SiLU-and-mul; both are compile-time switches
(HAS_BIAS, CLAMPED_SWIGLU), so the default experts run the kernels they ran before.
Imports triton at module level: reach it through moe.Experts (which checks triton is importable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.model.layers.moe_variants import ClampedSwiGLU


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs int32 [num_blocks * block_m], block_expert int32 [num_blocks]) for expert ids [T, k]:
    pair p = t * k + j; each expert's pairs in increasing order, its run padded with the sentinel T * k to a
    multiple of block_m; block_expert[b] the expert of rows b*block_m.., -1 past the last run."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = num_pairs // block_m + min(num_experts, num_pairs)  # sum over experts of ceil(count / block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = (padded_end - padded)[expert_of] + torch.arange(num_pairs, device=ids.device) - run_start[expert_of]
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _activate(gate, up, dtype: tl.constexpr, alpha, limit, CLAMPED_SWIGLU: tl.constexpr):
    """silu(gate) * up, or gpt-oss's (clamp(up) + 1) * clamp(gate) * sigmoid(alpha * clamp(gate)); gate and up
    float32 holding dtype values, each intermediate rounded to dtype as torch rounds it."""
    if CLAMPED_SWIGLU:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        sig = (1.0 / (1.0 + tl.exp(-(gate * alpha).to(dtype).to(tl.float32)))).to(dtype).to(tl.float32)
        glu = (gate * sig).to(dtype).to(tl.float32)
        return ((up + 1.0).to(dtype).to(tl.float32) * glu).to(dtype)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_pairs, top_k, hidden, inter,
                    stride_x, stride_we, stride_wn, stride_be, stride_out, alpha, limit,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                    HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr):
    """out[pair, n] = act(x[token] . w[e, n] (+ b[e, n]), x[token] . w[e, inter + n] (+ b[e, inter + n])) for the
    block's pairs (act: _activate)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols[None, :] + inter) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    gate, up = acc_gate.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32)
    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        b_gate = tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)
        b_up = tl.load(b_base + inter + cols, mask=col_ok, other=0.0).to(tl.float32)
        gate = (gate + b_gate[None, :]).to(dtype).to(tl.float32)
        up = (up + b_up[None, :]).to(dtype).to(tl.float32)
    act = _activate(gate, up, dtype, alpha, limit, CLAMPED_SWIGLU)
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :], act,
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_pairs, hidden, inter,
                 stride_a, stride_we, stride_wn, stride_be, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """out[pair, n] = scale[pair] * (a[pair] . w[e, n]) for the block's pairs (rounded once, to out's dtype); with
    HAS_BIAS, scale[pair] * round(round(a[pair] . w[e, n]) + b[e, n])."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        dtype = out_ptr.dtype.element_ty
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = (acc.to(dtype).to(tl.float32) + bias[None, :]).to(dtype).to(tl.float32)
    scale = tl.load(scale_ptr + rows, mask=valid, other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], (acc * scale[:, None]).to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows of a block: 16 (tl.dot's least) while experts average few rows; 64 once they fill such tiles."""
    return 16 if num_pairs < 16 * num_experts else 64


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, *, gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None, activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """moe.grouped_experts' result for x [T, H] (unit stride in H), gate_up [E, 2I, H], down [E, H, I]
    (contiguous in their last dimension), router weights float32 [T, k] and expert ids [T, k]; with the biases
    gate_up_bias [E, 2I] and down_bias [E, H] (both or neither) and gpt-oss's activation, what
    moe.Experts.forward_variant computes."""
    num_tokens, top_k = ids.shape
    num_experts, two_inter, hidden = gate_up.shape
    inter, num_pairs = two_inter // 2, ids.numel()
    x, gate_up, down = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, gate_up, down))
    has_bias = gate_up_bias is not None
    # without biases the weights stand in for the bias pointers (never read: HAS_BIAS is off)
    gate_up_bias = gate_up_bias.contiguous() if has_bias else gate_up
    down_bias = down_bias.contiguous() if down_bias is not None else down
    swiglu = activation if activation is not None else ClampedSwiGLU()  # its numbers unused when off
    block_m = _block_m(num_pairs, num_experts)
    sorted_pairs, block_expert = align_pairs(ids, num_experts, block_m)
    # float32 stays float32 (no TF32: its 10-bit mantissa would make the float32 path a low-precision one)
    precision = "ieee" if x.dtype == torch.float32 else None
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 64
    grid = (block_expert.numel(), triton.cdiv(inter, block_n))
    _gate_up_kernel[grid](x, gate_up, gate_up_bias, act, sorted_pairs, block_expert, num_pairs, top_k, hidden,
                          inter, x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_bias.stride(0),
                          act.stride(0), swiglu.alpha, swiglu.limit, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                          PRECISION=precision, HAS_BIAS=has_bias, CLAMPED_SWIGLU=activation is not None)
    rows = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    scales = weights.reshape(-1).to(torch.float32).contiguous()
    grid = (block_expert.numel(), triton.cdiv(hidden, block_n))
    _down_kernel[grid](act, down, down_bias, scales, rows, sorted_pairs, block_expert, num_pairs, hidden, inter,
                       act.stride(0), down.stride(0), down.stride(1), down_bias.stride(0), rows.stride(0),
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, HAS_BIAS=has_bias)
    return rows.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
