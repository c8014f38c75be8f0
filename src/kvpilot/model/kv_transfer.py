"""Disaggregation's copies between the paged KV cache and bytes on the wire (engine/kv_transfer.py has the contract,
docs/disaggregation.md the layout).

Wire layout of one block: [num_layers, 2 (K then V), kv_heads, block_size, head_dim] in the cache's dtype, C order,
the same as a KV offload tier slot (model/kv_offload.py); n blocks are n such runs back to back, in the order of
the block ids asked for. `read_blocks` runs on the KV sender's thread while the step loop runs: it only reads
blocks the KV manager holds for a finished request, which no step writes; `write_blocks` runs in the step that
admits the decode request, before its forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvpilot.model.kv_offload import _gather, _scatter


def kv_layout(kv_caches: Sequence[torch.Tensor]) -> dict[str, Any]:
    """What both sides of a transfer must agree on (the handshake compares it field by field)."""
    two, heads, _, block_size, head_dim = kv_caches[0].shape
    return {"num_layers": len(kv_caches), "num_kv_heads": int(heads), "block_size": int(block_size),
            "head_dim": int(head_dim), "dtype": str(kv_caches[0].dtype).removeprefix("torch."),
            "bytes_per_block": len(kv_caches) * two * heads * block_size * head_dim * kv_caches[0].element_size()}


@torch.inference_mode()
def read_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> memoryview:
    """The blocks' K/V of every layer, in the wire layout (a view of one host copy, for socket.sendall)."""
    data = _gather(kv_caches, list(block_ids)).contiguous().cpu()
    return memoryview(data.view(torch.uint8).reshape(-1).numpy())


@torch.inference_mode()
def write_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], data: bytes | bytearray) -> None:
    """Writes len(block_ids) blocks of wire-layout bytes into those blocks of every layer's cache."""
    first = kv_caches[0]
    two, heads, _, block_size, head_dim = first.shape
    writable = data if isinstance(data, bytearray) else bytearray(data)  # frombuffer wants a writable buffer
    raw = torch.frombuffer(writable, dtype=torch.uint8).view(first.dtype)
    blocks = raw.reshape(len(block_ids), len(kv_caches), two, heads, block_size, head_dim)
    _scatter(kv_caches, list(block_ids), blocks.to(first.device))
