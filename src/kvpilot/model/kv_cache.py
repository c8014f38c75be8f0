"""Allocation of the paged KV cache tensors, one per layer, in the attention backend's layout (the torch,
cpu and triton backends: [2, kv_heads, num_blocks, block_size, head_dim], head-major).

Its size in bytes is `kvpilot.fit.kv_cache.kv_cache_bytes_per_block` per block (the engine sizes it with fit)."""

from __future__ import annotations

import torch



def allocate_kv_cache(shape: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache per layer in the attention backend's layout (zeros keep padded, masked-out slots
    finite). `dtype` is the storage (kv_cache_dtype)."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
