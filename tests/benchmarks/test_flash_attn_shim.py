"""benchmarks/peers/flash_attn_shim: the Triton stand-in for flash-attn that nano-vllm runs on in gpu_peers.py,
checked against float64 attention (Triton's interpreter without a GPU; fp16 and fp32, since the interpreter
computes bf16 dots wrongly): prompts with and without a cached prefix through pages, decodes split and not,
empty contexts (as nano-vllm captures its graphs), stale block-table padding, grouped heads."""

from __future__ import annotations

import pytest
import torch

from tests.model.triton_cases import ON_GPU, TRITON_SKIP_REASON

pytestmark = pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
STALE_PAGE = 1  # block-table padding: a real page, so reading past a sequence's pages would show


def _shim():
    from peers.flash_attn_shim import flash_attn
    return flash_attn


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """float64 attention of q [nq, H, D] over keys/values [nk, KH, D], bottom-right causal alignment."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    keys, values = (t.double().repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    if causal:
        nq, nk = q.shape[0], keys.shape[0]
        allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if keys.shape[0] == 0:
        return torch.zeros(q.shape, dtype=torch.float64)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def _pages(num_pages: int, page: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    shape = (num_pages, page, kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _tables(key_counts: list[int], page: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Block tables with pages placed at random (pages 0 and STALE_PAGE never used), padded with STALE_PAGE."""
    widest = max(1, max(-(-n // page) for n in key_counts))
    free = (torch.randperm(num_pages - 2, generator=gen) + 2).tolist()
    table = torch.full((len(key_counts), widest), STALE_PAGE, dtype=torch.int32)
    for row, n in enumerate(key_counts):
        for i in range(-(-n // page)):
            table[row, i] = free.pop()
    return table


def _gather(pages: torch.Tensor, table_row: torch.Tensor, num_keys: int) -> torch.Tensor:
    page = pages.shape[1]
    return torch.cat([pages[int(table_row[i // page]), i % page][None] for i in range(num_keys)]) if num_keys else \
        pages[:0, 0]


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 4e-3


@pytest.mark.parametrize("group, head_dim, dtype, causal", [
    (1, 64, torch.float32, True), (2, 128, torch.float16, True), (4, 64, torch.float16, False),
    (2, 80, torch.float32, True)])
def test_prompts_from_rows_match_float64(group, head_dim, dtype, causal):
    gen = torch.Generator().manual_seed(0)
    lengths, kv_heads = [1, 7, 33, 130], 2
    heads, total = group * kv_heads, sum(lengths)
    q, k, v = (torch.randn((total, n, head_dim), generator=gen).to(dtype) for n in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    scale = head_dim ** -0.5
    out = _shim().flash_attn_varlen_func(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu.to(DEVICE), cu.to(DEVICE),
                                         max(lengths), max(lengths), softmax_scale=scale, causal=causal).cpu()
    assert out.shape == q.shape and out.dtype == dtype
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        expected = _reference(q[rows], k[rows], v[rows], scale, causal)
        torch.testing.assert_close(out[rows].double(), expected, atol=_tolerance(dtype), rtol=0)


@pytest.mark.parametrize("page, dtype", [(16, torch.float32), (256, torch.float16)])
def test_prompt_chunks_after_a_cached_prefix_read_pages(page, dtype):
    """nano-vllm's prefix-cache and chunked-prefill step: the new tokens' K/V already written to the pages,
    queries the last num_queries of each sequence's keys."""
    gen = torch.Generator().manual_seed(1)
    seqs = [(0, 5), (16, 3), (37, 20), (page + 3, 2), (2 * page - 1, 40)]  # (cached keys, new queries)
    kv_heads, heads, head_dim = 2, 4, 64
    key_counts = [c + n for c, n in seqs]
    k_pages, v_pages = _pages(2 + sum(-(-n // page) for n in key_counts), page, kv_heads, head_dim, dtype, gen)
    table = _tables(key_counts, page, k_pages.shape[0], gen)
    q = torch.randn((sum(n for _, n in seqs), heads, head_dim), generator=gen).to(dtype)
    cu_q = torch.tensor([0] + torch.tensor([n for _, n in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(key_counts).cumsum(0).tolist(), dtype=torch.int32)
    out = _shim().flash_attn_varlen_func(
        q.to(DEVICE), k_pages.to(DEVICE), v_pages.to(DEVICE), cu_q.to(DEVICE), cu_k.to(DEVICE),
        max(n for _, n in seqs), max(key_counts), softmax_scale=0.125, causal=True, block_table=table.to(DEVICE)).cpu()
    for b, n in enumerate(key_counts):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys, values = _gather(k_pages, table[b], n), _gather(v_pages, table[b], n)
        torch.testing.assert_close(out[rows].double(), _reference(q[rows], keys, values, 0.125, True),
                                   atol=_tolerance(dtype), rtol=0)


@pytest.mark.parametrize("key_counts, group, page, dtype", [
    ([0, 1, 15, 16, 17, 300], 2, 16, torch.float32),  # batch x heads fill the grid: one split
    ([700], 4, 16, torch.float16),  # one sequence: the context split, then reduced
    ([0, 0], 1, 16, torch.float32),  # empty contexts, as nano-vllm captures its graphs: zeros
    ([5, 600], 8, 256, torch.float16)])
def test_decode_over_pages_matches_float64(key_counts, group, page, dtype):
    gen = torch.Generator().manual_seed(2)
    kv_heads, head_dim = 1 if len(key_counts) == 1 else 2, 64
    heads = group * kv_heads
    k_pages, v_pages = _pages(3 + sum(-(-n // page) for n in key_counts), page, kv_heads, head_dim, dtype, gen)
    table = _tables(key_counts, page, k_pages.shape[0], gen)
    table = torch.cat([table, torch.full((len(key_counts), 1), STALE_PAGE, dtype=torch.int32)], 1)  # graph width
    q = torch.randn((len(key_counts), 1, heads, head_dim), generator=gen).to(dtype)
    lens = torch.tensor(key_counts, dtype=torch.int32)
    shim = _shim()
    out = shim.flash_attn_with_kvcache(q.to(DEVICE), k_pages.to(DEVICE), v_pages.to(DEVICE),
                                       cache_seqlens=lens.to(DEVICE), block_table=table.to(DEVICE),
                                       softmax_scale=0.125, causal=True).cpu()
    assert out.shape == q.shape and out.dtype == dtype
    for b, n in enumerate(key_counts):
        expected = _reference(q[b], _gather(k_pages, table[b], n), _gather(v_pages, table[b], n), 0.125, True)
        torch.testing.assert_close(out[b].double(), expected, atol=_tolerance(dtype), rtol=0)


def test_decode_splits_follow_shapes_only():
    splits = _shim().decode_splits
    assert splits(batch=256, kv_heads=8, max_keys=4096, num_sms=132, block_n=64) == 1
    assert splits(batch=1, kv_heads=8, max_keys=4096, num_sms=132, block_n=64) == 64  # capped
    assert splits(batch=1, kv_heads=8, max_keys=256, num_sms=132, block_n=64) == 4  # no split under a tile
    assert splits(batch=4, kv_heads=8, max_keys=4096, num_sms=132, block_n=64) == 16


def test_options_it_does_not_implement_are_refused():
    shim = _shim()
    q = torch.zeros((2, 1, 2, 64), device=DEVICE)
    pages = torch.zeros((2, 16, 1, 64), device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    table = torch.zeros((2, 1), dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="window_size"):
        shim.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table, window_size=(8, 0))
    with pytest.raises(NotImplementedError, match="one query token"):
        shim.flash_attn_with_kvcache(q.expand(2, 2, 2, 64), pages, pages, cache_seqlens=lens, block_table=table)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="softcap"):
        shim.flash_attn_varlen_func(q[:, 0], pages[0], pages[0], cu, cu, 2, 2, softcap=30.0)
