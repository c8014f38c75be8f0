"""Builds small paged-attention steps for the Triton backend tests: sequences at chosen (start, query_len),
blocks placed at random, block tables padded with stale ids, a cache whose earlier positions hold random K/V."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.triton_support import interpreting, triton_importable

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit decorates the kernels (imported later)


def _version(text: str) -> tuple[int, int]:
    return tuple(int(p) for p in text.split(".")[:2])  # type: ignore[return-value]


def _triton_skip_reason() -> str | None:
    if not triton_importable():
        return "triton is not installed (pip install -e '.[test-gpu]')"
    import triton
    if not ON_GPU and _version(triton.__version__) < (3, 7) and _version(np.__version__) >= (2, 4):
        return f"Triton {triton.__version__}'s interpreter fails with NumPy >= 2.4: triton >= 3.7 runs it"
    if not ON_GPU and not interpreting():
        return "no GPU and TRITON_INTERPRET is off"
    return None


TRITON_SKIP_REASON = _triton_skip_reason()

STALE_BLOCK = 3  # padding past a sequence's blocks: a real block id, so reading it unmasked would show


@dataclass(frozen=True)
class Step:
    layout: StepLayout
    q: torch.Tensor  # [T, heads, D]
    k: torch.Tensor  # [T, kv_heads, D]
    v: torch.Tensor
    cache: torch.Tensor  # [2, kv_heads, num_blocks, block_size, D], earlier tokens filled


def fp8_exact(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded so that x / scale is an fp8 (e4m3) value: storing it loses nothing. (Triton's interpreter
    rounds to fp8 wrongly, e.g. 1.94 -> 1.0; on a GPU the conversion rounds to nearest, like torch.)"""
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def make_step(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, kv_dtype: torch.dtype, seed: int = 0, kv_scale: float = 1.0) -> Step:
    """seqs: (start_position, query_len) per sequence, in step order. With an fp8 cache, new K/V are
    fp8-exact at kv_scale and the cache holds raw fp8 values (to be read times kv_scale)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-(start + n) // block_size) for start, n in seqs]
    num_blocks = sum(blocks_per_seq) + 4
    perm = rng.permutation(num_blocks)
    width = max(blocks_per_seq) + 2
    tables = np.full((len(seqs), width), STALE_BLOCK, dtype=np.int64)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used: used + n]
        used += n
    starts = np.array([s for s, _ in seqs], dtype=np.int64)
    lens = np.array([n for _, n in seqs], dtype=np.int64)
    query_start = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    slots = []
    for i, (start, n) in enumerate(seqs):
        pos = np.arange(start, start + n)
        slots.append(tables[i, pos // block_size] * block_size + pos % block_size)
    layout = StepLayout(query_start, lens, starts, tables, np.concatenate(slots).astype(np.int64), block_size)
    total = int(lens.sum())
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen)
    v = torch.randn(total, kv_heads, head_dim, generator=gen)
    if kv_dtype == torch.float8_e4m3fn:
        k, v = fp8_exact(k, kv_scale), fp8_exact(v, kv_scale)
    k, v = k.to(dtype), v.to(dtype)
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen).to(kv_dtype)
    return Step(layout, q, k, v, cache)
