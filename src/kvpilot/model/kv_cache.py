"""Allocation of the paged KV cache tensors, one per layer, in the attention backend's layout (the torch,
cpu and triton backends: [2, kv_heads, num_blocks, block_size, head_dim], head-major).

Its size in bytes is `kvpilot.fit.kv_cache.kv_cache_bytes_per_block` per block (the engine sizes it with fit)."""

from __future__ import annotations

import torch

from kvpilot.model.huge_pages import advise_huge_pages


def allocate_kv_cache(shape: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache per layer in the attention backend's layout (zeros keep padded, masked-out slots
    finite). `dtype` is the storage (kv_cache_dtype). On CPU on huge pages where the system grants them
    (kvpilot.model.huge_pages: blocks are read at scattered places)."""
    return [_zeros(shape, dtype, device) for _ in range(num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    cache = torch.empty(shape, dtype=dtype)
    advise_huge_pages(cache)  # before the zeros touch it: the pages are chosen at the first write
    return cache.zero_()
