"""Turns one step's scheduled chunks into the flattened tensors the model runs on.

Contract (kvpilot.engine.scheduler_output.ScheduledChunk): each chunk has token_ids, start_position and the
request's block table; token i of a chunk has position start_position + i and is stored in slot
block_ids[pos // block_size] * block_size + pos % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from kvpilot.model.layers.attention_metadata import AttentionMetadata, DecodeBatch, PrefillSeq, make_key_bias


class ChunkLike(Protocol):
    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    needs_sample: bool

    @property
    def is_decode(self) -> bool: ...


@dataclass(frozen=True)
class ModelInput:
    """Flattened step input. Invariant: sample_rows[i] is the last row of the i-th chunk that needs a sample."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N] long
    sample_request_ids: list[str]


def _slots(chunk: ChunkLike, block_size: int) -> list[int]:
    blocks = chunk.block_ids
    return [blocks[p // block_size] * block_size + p % block_size
            for p in range(chunk.start_position, chunk.start_position + len(chunk.token_ids))]


def _prefill_mask(start: int, query_len: int, device: torch.device) -> torch.Tensor | None:
    if start == 0:
        return None
    query_pos = torch.arange(start, start + query_len, device=device)[:, None]
    key_pos = torch.arange(start + query_len, device=device)[None, :]
    return key_pos <= query_pos


DECODE_GROUP_SPREAD = 1.5  # a group's longest block table is at most this times its shortest...
MIN_DECODE_GROUP = 8  # ...unless the group is still small (tiny matmuls cost more than padding)


def _decode_groups(chunks: Sequence[ChunkLike], rows: list[int], block_size: int,
                   device: torch.device, decode_kernel: bool) -> list[DecodeBatch]:
    """Decodes grouped by context length, so padding to the longest table wastes little gather bandwidth.

    The C++ kernel reads only each sequence's own blocks, so it takes every decode in one batch, unpadded.
    """
    if not chunks:
        return []
    if decode_kernel:
        return [_decode_batch(chunks, rows, block_size, device, with_bias=False)]
    order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].block_ids))
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is None or (len(chunks[i].block_ids) > DECODE_GROUP_SPREAD * len(chunks[group[0]].block_ids)
                             and len(group) >= MIN_DECODE_GROUP):
            groups.append([i])
        else:
            group.append(i)
    return [_decode_batch([chunks[i] for i in g], [rows[i] for i in g], block_size, device, with_bias=True)
            for g in groups]


def _decode_batch(chunks: Sequence[ChunkLike], rows: list[int], block_size: int,
                  device: torch.device, with_bias: bool = True) -> DecodeBatch:
    max_blocks = max(len(c.block_ids) for c in chunks)
    # one tensor from padded lists: a per-row torch.tensor() costs more than the rest of this at batch 128
    tables = torch.tensor([c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks], dtype=torch.long)
    context_lens = torch.tensor([c.start_position + 1 for c in chunks], dtype=torch.long)
    bias = make_key_bias(context_lens, max_blocks * block_size).to(device) if with_bias else None
    consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeBatch(token_rows=torch.tensor(rows, dtype=torch.long, device=device),
                       row_range=(rows[0], rows[0] + len(rows)) if consecutive else None,
                       block_tables=tables.to(device), context_lens=context_lens.to(device), key_bias=bias)


def build_model_input(chunks: Sequence[ChunkLike], block_size: int, device: torch.device,
                      decode_kernel: bool = False) -> ModelInput:
    """Flattens chunks in their given order; single-token chunks (with context) join the batched decode.

    decode_kernel: decode attention will run in the C++ kernel (one unpadded batch, no key bias).
    """
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    prefills: list[PrefillSeq] = []
    decode_chunks: list[ChunkLike] = []
    decode_rows: list[int] = []
    sample_rows: list[int] = []
    sample_ids: list[str] = []
    for chunk in chunks:
        start_row, n = len(token_ids), len(chunk.token_ids)
        token_ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start_position, chunk.start_position + n))
        slots.extend(_slots(chunk, block_size))
        if chunk.is_decode:
            decode_chunks.append(chunk)
            decode_rows.append(start_row)
        else:
            prefills.append(PrefillSeq(
                query_start=start_row, query_len=n, context_len=chunk.start_position + n,
                block_ids=torch.tensor(chunk.block_ids, dtype=torch.long, device=device),
                mask=_prefill_mask(chunk.start_position, n, device)))
        if chunk.needs_sample:
            sample_rows.append(start_row + n - 1)
            sample_ids.append(chunk.request_id)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), prefills=prefills,
        decodes=_decode_groups(decode_chunks, decode_rows, block_size, device, decode_kernel),
        num_tokens=len(token_ids))
    return ModelInput(token_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
                      positions=torch.tensor(positions, dtype=torch.long, device=device), meta=meta,
                      sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
                      sample_request_ids=sample_ids)
