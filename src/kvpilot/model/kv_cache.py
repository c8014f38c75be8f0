"""Allocation of the paged KV cache tensors, one per layer, in the attention backend's layout (the torch,
cpu and triton backends: [2, kv_heads, num_blocks, block_size, head_dim], head-major).

Its size in bytes is `kvpilot.fit.kv_cache.kv_cache_bytes_per_block` per block (the engine sizes it with fit)."""

from __future__ import annotations

import math
import mmap

import torch

from kvpilot.model.huge_pages import advise_huge_pages


def allocate_kv_cache(shape: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache per layer in the attention backend's layout (zeros keep padded, masked-out slots
    finite). `dtype` is the storage (kv_cache_dtype). On CPU on huge pages where the system grants them
    (kvpilot.model.huge_pages: blocks are read at scattered places)."""
    return [_zeros(shape, dtype, device) for _ in range(num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if device.type != "cpu" or nbytes == 0 or None in flags:
        return torch.zeros(shape, dtype=dtype, device=device)
    # A private anonymous mapping reads as zeros and takes memory only where it is written: start-up does not
    # write the whole cache (~1 s for 2 GiB on 2 cores), and the server's resident memory grows with the
    # blocks in use. The tensor holds the mapping (torch.frombuffer keeps a reference).
    region = mmap.mmap(-1, nbytes, flags=flags[0] | flags[1])
    cache = torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
    advise_huge_pages(cache)  # before any write: the pages are chosen at the first one
    return cache
