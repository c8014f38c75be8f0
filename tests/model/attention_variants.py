"""Paged-attention steps and a dense reference for the attention-variant tests (sliding window, logit soft-cap,
sinks): random K/V in shuffled blocks (tests.model.triton_cases.make_step), and, with a window, every block-table
entry wholly before the window of the sequence's first query pointed at a block of NaNs, so a backend that reads
one (rather than skipping it) shows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.model.attention.base import LayerAttention
from kvpilot.model.attention.layout import StepLayout
from tests.model.triton_cases import make_step


@dataclass(frozen=True)
class VariantStep:
    layout: StepLayout  # block tables with the out-of-window entries pointing at the NaN block
    q: torch.Tensor  # [T, heads, D]
    k: torch.Tensor  # [T, kv_heads, D]
    v: torch.Tensor
    cache: torch.Tensor  # [2, kv_heads, num_blocks + 1, block_size, D]: the last block all NaN
    expected: torch.Tensor  # [T, heads, D] float64: the dense reference


def variant_step(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, layer: LayerAttention, seed: int = 0) -> VariantStep:
    """seqs: (start_position, query_len) per sequence, in step order."""
    step = make_step(seqs, heads, kv_heads, head_dim, block_size, dtype, dtype, seed=seed)
    expected = dense_reference(seqs, step.layout, step.q, step.k, step.v, step.cache, layer)
    num_blocks = step.cache.shape[2]
    nan_block = torch.full_like(step.cache[:, :, :1], float("nan"))
    cache = torch.cat([step.cache, nan_block], dim=2)
    tables = step.layout.block_tables.copy()
    if layer.sliding_window is not None:
        for i, (start, _) in enumerate(seqs):
            first_key = max(0, start - layer.sliding_window + 1)
            tables[i, : first_key // block_size] = num_blocks
    layout = StepLayout(step.layout.query_start, step.layout.query_lens, step.layout.start_positions, tables,
                        step.layout.slot_mapping, block_size)
    return VariantStep(layout, step.q, step.k, step.v, cache, expected)


def dense_reference(seqs: list[tuple[int, int]], layout: StepLayout, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, cache: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
    """Plain float64 softmax attention per sequence over its whole context (cached keys through its table, then
    the step's own), with the full causal + window mask, soft-cap and sinks: HF transformers' eager attention."""
    heads, kv_heads = q.shape[1], k.shape[1]
    block_size = cache.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (start, query_len) in enumerate(seqs):
        rows = slice(int(layout.query_start[i]), int(layout.query_start[i]) + query_len)
        pos = np.arange(start)
        slots = torch.from_numpy(layout.block_tables[i, pos // block_size] * block_size + pos % block_size)
        flat = cache.reshape(2, kv_heads, -1, cache.shape[-1]).double()
        keys = torch.cat([flat[0][:, slots], k[rows].double().transpose(0, 1)], dim=1)  # [kvH, ctx, D]
        values = torch.cat([flat[1][:, slots], v[rows].double().transpose(0, 1)], dim=1)
        keys = keys.repeat_interleave(heads // kv_heads, dim=0)
        values = values.repeat_interleave(heads // kv_heads, dim=0)
        scores = torch.einsum("qhd,hkd->hqk", q[rows].double(), keys) * layer.scale
        if layer.logit_softcap is not None:
            scores = torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap
        query_pos = torch.arange(start, start + query_len)[:, None]
        key_pos = torch.arange(start + query_len)[None, :]
        visible = key_pos <= query_pos
        if layer.sliding_window is not None:
            visible &= key_pos > query_pos - layer.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if layer.sinks is not None:
            sink = layer.sinks.double().view(heads, 1, 1).expand(heads, query_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("hqk,hkd->qhd", probs, values)
    return out


def layer_of(kind: str, heads: int, scale: float, window: int = 6, seed: int = 0) -> LayerAttention:
    """A LayerAttention per test id: plain, window, softcap, sinks, or all (window + softcap + sinks)."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed + 100)) * 2.0
    return {
        "plain": LayerAttention(scale),
        "window": LayerAttention(scale, sliding_window=window),
        "softcap": LayerAttention(scale, logit_softcap=1.5),
        "sinks": LayerAttention(scale, sinks=sinks),
        "all": LayerAttention(scale, sliding_window=window, logit_softcap=1.5, sinks=sinks),
    }[kind]
