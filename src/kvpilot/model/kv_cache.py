"""Allocation of the paged KV cache tensors: one [2, kv_heads, num_blocks, block_size, head_dim]
per layer (head-major: a gather by block id yields [kv_heads, tokens, head_dim] with no transpose).

Its size in bytes is `kvpilot.fit.kv_cache.kv_cache_bytes_per_block` per block (the engine sizes it with fit)."""

from __future__ import annotations

import torch

from kvpilot.model.config import ModelConfig


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """Zeroed caches (zeros keep padded, masked-out slots finite). `dtype` is the storage (kv_cache_dtype)."""
    shape = (2, config.num_key_value_heads, num_blocks, block_size, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
