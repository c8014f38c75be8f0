"""Allocation of the paged KV cache tensors, one per layer, in the attention backend's layout (the torch,
cpu and triton backends: [2, kv_heads, num_blocks, block_size, head_dim], head-major).

Its size in bytes is `kvpilot.fit.kv_cache.kv_cache_bytes_per_block` per block (the engine sizes it with fit)."""

from __future__ import annotations

import math
import mmap

import torch


def allocate_kv_cache(shape: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache per layer in the attention backend's layout (zeros keep padded, masked-out slots
    finite). `dtype` is the storage (kv_cache_dtype)."""
    return [_zeros(shape, dtype, device) for _ in range(num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if device.type != "cpu" or nbytes == 0 or None in flags:
        return torch.zeros(shape, dtype=dtype, device=device)
    # A private anonymous mapping reads as zeros and takes memory only where it is written: start-up does not
    # write the whole cache (~1 s for 2 GiB on 2 cores), and the server's resident memory grows with the
    # blocks in use. The tensor holds the mapping (torch.frombuffer keeps a reference).
    # On 4 KiB pages: 2 MiB pages (madvise(MADV_HUGEPAGE)) made scattered block reads ~12% faster, but where the
    # kernel compacts memory to grant one at its first write (THP defrag "madvise", a common default), a prompt's
    # first write to fresh blocks took ~10x as long (~25 ms a 128-token prompt on a 2-vCPU VM): a cost every
    # request pays until the whole pool has been used once (docs/benchmark-log.md, 2026-12-02).
    region = mmap.mmap(-1, nbytes, flags=flags[0] | flags[1])
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
