"""The C++ paged decode kernel equals the torch decode path (same inputs, scattered blocks, GQA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpilot.model.attention.metadata import make_decode_batch
from kvpilot.model.layers.cpu_decode_kernel import get_kernel
from kvpilot.model.layers.paged_attention import decode_kernel, decode_torch


def _kernel(q: torch.Tensor, cache: torch.Tensor, batch, scale: float) -> torch.Tensor:
    """The kernel's output for the batch's rows (written into a full-size output, as the model does)."""
    out = torch.full_like(q, float("nan"))
    assert decode_kernel(q, cache, batch, scale, out)
    return batch.rows_of(out)


class _Chunk:
    """A decode at position `start` over `blocks`."""

    def __init__(self, start: int, blocks: list[int]) -> None:
        self.start_position, self.block_ids = start, blocks


def _decode_batch(chunks, rows, block_size, device, with_bias=True):
    """Block tables padded with stale ids (9), as the runner's persistent table may hold: never read."""
    width = max(len(c.block_ids) for c in chunks) + 2
    tables = np.array([c.block_ids + [9] * (width - len(c.block_ids)) for c in chunks], dtype=np.int64)
    lens = np.array([c.start_position + 1 for c in chunks], dtype=np.int64)
    return make_decode_batch(tables, lens, np.array(rows, dtype=np.int64), block_size, device, with_bias)


@pytest.mark.skipif(get_kernel() is None, reason="no C++ toolchain: the torch path is used")
@pytest.mark.parametrize("heads, kv_heads, block_size, head_dim",
                         [(9, 3, 16, 64), (8, 8, 4, 64), (16, 2, 8, 128), (8, 2, 32, 128), (4, 2, 16, 80)])
def test_kernel_matches_torch_path(heads, kv_heads, block_size, head_dim):
    """Head dims 64 and 128 take the compiled-size paths, 80 the generic one; on AVX-512, blocks of 16 rows or
    more take the 16-row dot products (one summing tree), smaller ones and tails the row-by-row sums."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = 40
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen)
    contexts = [1, block_size, block_size + 1, 3 * block_size - 2, 60]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, used = [], 0
    for ctx in contexts:
        n = (ctx + block_size - 1) // block_size
        chunks.append(_Chunk(ctx - 1, perm[used:used + n]))
        used += n
    batch = _decode_batch(chunks, [2 * i for i in range(len(chunks))], block_size, torch.device("cpu"))
    q = torch.randn(2 * len(chunks), heads, head_dim, generator=gen)
    fast = _kernel(q, cache, batch, head_dim ** -0.5)
    torch.testing.assert_close(fast, decode_torch(q, cache, batch, head_dim ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(get_kernel() is None, reason="no C++ toolchain: the torch path is used")
def test_consecutive_rows_of_a_strided_query_view_are_read_and_written_in_place():
    """As in the model: q is a view of the fused q|k projection (row stride wider than heads x dim), the
    decodes are rows 1..3 of the step; the kernel writes exactly those rows of the output."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, block_size, head_dim = 6, 2, 8, 64
    cache = torch.randn(2, kv_heads, 16, block_size, head_dim, generator=gen)
    chunks = [_Chunk(4, [3]), _Chunk(20, [0, 9, 4]), _Chunk(11, [1, 2])]
    batch = _decode_batch(chunks, [1, 2, 3], block_size, torch.device("cpu"), with_bias=False)
    assert batch.row_range == (1, 4)
    qk = torch.randn(5, heads + kv_heads, head_dim, generator=gen)
    q = qk[:, :heads]
    assert not q.is_contiguous()
    out = torch.full_like(q.contiguous(), float("nan"))
    assert decode_kernel(q, cache, batch, 0.125, out)
    expected = decode_torch(q.contiguous(), cache, batch, 0.125)
    torch.testing.assert_close(out[1:4], expected, rtol=1e-5, atol=1e-6)
    assert out[0].isnan().all() and out[4].isnan().all()  # rows of other sequences untouched


def test_torch_path_builds_the_padding_bias_when_the_batch_has_none():
    gen = torch.Generator().manual_seed(1)
    block_size, head_dim = 4, 64
    cache = torch.randn(2, 2, 12, block_size, head_dim, generator=gen)
    chunks = [_Chunk(2, [5]), _Chunk(9, [0, 7, 3])]
    q = torch.randn(2, 4, head_dim, generator=gen)
    with_bias = _decode_batch(chunks, [0, 1], block_size, torch.device("cpu"), with_bias=True)
    without = _decode_batch(chunks, [0, 1], block_size, torch.device("cpu"), with_bias=False)
    assert without.key_bias is None
    torch.testing.assert_close(decode_torch(q, cache, without, 0.125), decode_torch(q, cache, with_bias, 0.125))


@pytest.mark.skipif(get_kernel() is None, reason="no C++ toolchain: the torch path is used")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("head_dim, block_size", [(64, 8), (64, 16), (80, 8)])
def test_kernel_widens_16_and_8_bit_kv_like_torch(kv_dtype, head_dim, block_size):
    """The kernel's own bf16/fp16/fp8 -> float32 conversion equals torch's, subnormals and signs included,
    on the AVX-512 path (head dim 64, where the CPU has it) and the portable one (80)."""
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 2, 20, block_size, head_dim, generator=gen)
    cache[..., :4] *= 1e-6  # subnormal in fp16 / fp8 (fp8 has them below 2^-6)
    cache[..., 4:8] *= 0.01
    stored = cache.to(kv_dtype)
    chunks = [_Chunk(0, [3]), _Chunk(20, [0, 9, 4]), _Chunk(37, [1, 2, 5, 6, 7])]
    batch = _decode_batch(chunks, [0, 1, 2], block_size, torch.device("cpu"), with_bias=False)
    q = torch.randn(3, 6, head_dim, generator=gen)
    fast = _kernel(q, stored, batch, 0.125)
    torch.testing.assert_close(fast, decode_torch(q, stored.float(), batch, 0.125), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(decode_torch(q, stored, batch, 0.125), decode_torch(q, stored.float(), batch, 0.125))


@pytest.mark.skipif(get_kernel() is None, reason="no C++ toolchain: the torch path is used")
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [[1, 2, 3], [0, 2, 4]], ids=["consecutive", "scattered"])
def test_16_bit_queries_are_widened_and_the_output_narrowed(q_dtype, rows):
    """bf16 / fp16 activations (the CPU default with AVX512_BF16) run in the kernel too: the queries widened
    to float32, the result written back in the output's dtype, into exactly the decode rows."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, block_size, head_dim = 6, 2, 8, 64
    cache = torch.randn(2, kv_heads, 16, block_size, head_dim, generator=gen).to(q_dtype)
    chunks = [_Chunk(4, [3]), _Chunk(20, [0, 9, 4]), _Chunk(11, [1, 2])]
    batch = _decode_batch(chunks, rows, block_size, torch.device("cpu"), with_bias=False)
    q = torch.randn(5, heads, head_dim, generator=gen).to(q_dtype)
    out = torch.full_like(q, float("nan"))
    assert decode_kernel(q, cache, batch, 0.125, out)
    wide = _kernel(q.float(), cache, batch, 0.125)
    assert torch.equal(out[rows], wide.to(q_dtype))  # the float32 kernel's result, rounded once
    torch.testing.assert_close(wide, decode_torch(q.float(), cache.float(), batch, 0.125), rtol=1e-5, atol=1e-6)
    others = [r for r in range(5) if r not in rows]
    assert out[others].isnan().all()


@pytest.mark.skipif(get_kernel() is None, reason="no C++ toolchain: the torch path is used")
def test_kernel_runs_on_all_of_torchs_threads():
    """Built without OpenMP, the parallel_for inlined into the extension runs serially (no error, half speed)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert get_kernel().parallel_width() == 2
        torch.set_num_threads(1)
        assert get_kernel().parallel_width() == 1
    finally:
        torch.set_num_threads(before)
