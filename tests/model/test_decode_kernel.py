"""The C++ paged decode kernel equals the torch decode path (same inputs, scattered blocks, GQA)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.model.layers.cpu_decode_kernel import get_kernel
from kvpilot.model.layers.paged_attention import decode_kernel, decode_torch
from kvpilot.model.batch_builder import _decode_batch


class _Chunk:
    def __init__(self, start: int, blocks: list[int]) -> None:
        self.request_id, self.token_ids, self.start_position, self.block_ids, self.needs_sample = \
            "r", [0], start, blocks, True


@pytest.mark.skipif(get_kernel() is None, reason="no C++ toolchain: the torch path is used")
@pytest.mark.parametrize("heads, kv_heads, block_size", [(9, 3, 16), (8, 8, 4), (16, 2, 8)])
def test_kernel_matches_torch_path(heads, kv_heads, block_size):
    gen = torch.Generator().manual_seed(0)
    head_dim, num_blocks = 64, 40
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
    fast = decode_kernel(q, cache, batch, head_dim ** -0.5)
    assert fast is not None
    torch.testing.assert_close(fast, decode_torch(q, cache, batch, head_dim ** -0.5), rtol=1e-5, atol=1e-5)
