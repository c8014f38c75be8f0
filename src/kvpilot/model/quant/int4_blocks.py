"""An Int4Weight as the CPU kernels' GGUF-style blocks of 32 (PackedWeight), where its groups map onto them.

A group of 32, 64, 128 ... consecutive inputs (or one group a row) is 1, 2, 4 ... blocks with the group's scale
and zero point each (regrouping is exact: the values do not change). Per block, w = d * q + m:
- symmetric weights (every zero point 8: GPTQ `sym`, compressed-tensors `symmetric`) are Q4_0, d * (q - 8) with
  d = scale: exact;
- the others (AWQ, asymmetric GPTQ) are Q4_1 with d = scale, m = -scale * zero rounded to float16 (what Q4_1
  stores): exact where the product fits float16's 11-bit mantissa, else off by at most half its last place,
  2^-11 |scale * zero| <= 0.8% of the quantization step (15 * 2^-11), far below the 4-bit rounding the
  checkpoint already holds. `offset_error` reports the largest such error of a weight.
Scales must be float16 values (AWQ and GPTQ store float16; bfloat16 scales of compressed-tensors usually are).
What does not map (act-order g_idx whose groups cut through blocks, groups not a multiple of 32, inputs not a
multiple of 32, scales outside float16) stays an Int4Weight: the loader dequantizes it, saying why.
"""

from __future__ import annotations

import torch

from kvpilot.model.quant.formats import BLOCK_VALUES, Q4_0, Q4_1
from kvpilot.model.quant.int4_weight import Int4Weight
from kvpilot.model.quant.packed import PackedWeight


def block_mapping_problem(w: Int4Weight) -> str | None:
    """Why `w` does not map onto blocks of 32, or None when it does."""
    k = w.in_features
    if k % BLOCK_VALUES:
        return f"{k} input features are not a multiple of {BLOCK_VALUES}"
    g = w.g_idx.view(k // BLOCK_VALUES, BLOCK_VALUES)
    if not bool((g == g[:, :1]).all()):
        return "its groups (act-order g_idx, or a group size that is not a multiple of 32) cut through blocks of 32"
    if not torch.equal(w.scales.to(torch.float16).to(torch.float32), w.scales):
        return "its scales are not float16 values"
    return None


def to_blocks(w: Int4Weight) -> PackedWeight:
    """The blocks of `w` (Q4_0 when every zero point is 8, else Q4_1); ValueError where
    block_mapping_problem(w) names a reason."""
    problem = block_mapping_problem(w)
    if problem is not None:
        raise ValueError(problem)
    k, n = w.in_features, w.out_features
    blocks = k // BLOCK_VALUES
    group = w.g_idx[::BLOCK_VALUES].long()  # each block's group
    scale = w.scales[group].t().contiguous()  # [N, KB]
    zero = w.zeros[group].t().to(torch.float32)
    values = w.values().t().reshape(n, blocks, 2, BLOCK_VALUES // 2)  # [N, KB, half, 16]
    qs = (values[:, :, 0] | (values[:, :, 1] << 4)).reshape(n, blocks * BLOCK_VALUES // 2).contiguous()
    d = scale.to(torch.float16)
    if bool((w.zeros == 8).all()):
        return PackedWeight(Q4_0, qs, d, None)
    return PackedWeight(Q4_1, qs, d, (-scale * zero).to(torch.float16))


def offset_error(w: Int4Weight, blocks: PackedWeight) -> float:
    """The largest |m - (-scale * zero)| over the blocks (0 for Q4_0): what rounding Q4_1's minimum to float16
    moved a weight by."""
    if blocks.m is None:
        return 0.0
    group = w.g_idx[::BLOCK_VALUES].long()
    exact = -(w.scales[group] * w.zeros[group].to(torch.float32)).t()
    return float((blocks.m.to(torch.float32) - exact).abs().max()) if exact.numel() else 0.0
