"""The Triton backend's per-step metadata, packed into one persistent int32 buffer on the device.

Every step's integer inputs (query starts, context lengths, which sequences decode and which prefill, the
slot mapping, the block tables) go to the device in one asynchronous copy (kvpilot.model.device_staging), of
which the metadata tensors are views. Reserved up front for max_num_seqs x max blocks, a decode step of a
fixed batch size and table width always lands at the same device addresses, which is what a captured CUDA
graph needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.triton_split import DecodeSplit
from kvpilot.model.device_staging import PackedArrays


PACKED_ARRAYS = 6  # arrays pack_layout sends (each starts 16-byte aligned in the buffer)


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """Invariants: S sequences in step order, T tokens. query_start[S] == T; sequence s owns token rows
    query_start[s]..query_start[s+1]-1 and keys 0..seq_lens[s]-1, the last (query_start[s+1] -
    query_start[s]) of them its queries; block_tables[s, :ceil(seq_lens[s] / block_size)] is its table
    (later columns are never read); decode_seqs and prefill_seqs partition range(S)."""

    query_start: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    decode_seqs: torch.Tensor  # [num_decodes] int32: sequences with one query after earlier tokens
    prefill_seqs: torch.Tensor  # [num_prefills] int32: the others (prompts, chunks)
    slot_mapping: torch.Tensor  # [T] int32: cache slot of each token
    block_tables: torch.Tensor  # [S, table_width] int32
    num_tokens: int
    max_prefill_len: int  # longest query among the prefills (0 when none): sizes the prefill grid
    decode_split: DecodeSplit


def pack_layout(layout: StepLayout, packed: PackedArrays, decode_split: DecodeSplit,
                table_width: int | None = None) -> TritonAttentionMetadata:
    """The step's metadata from its StepLayout. table_width: columns of block table to send (None: the
    step's widest need; a CUDA graph passes its fixed width)."""
    context_lens = layout.context_lens
    num_seqs = len(context_lens)
    needed = int(-(-context_lens.max() // layout.block_size)) if num_seqs else 0
    width = max(table_width or needed, 1)
    tables = np.zeros((num_seqs, width), dtype=np.int32)
    copied = min(width, layout.block_tables.shape[1])
    tables[:, :copied] = layout.block_tables[:, :copied]
    is_decode = layout.is_decode
    query_start = np.append(layout.query_start, layout.num_tokens)
    decode_seqs, prefill_seqs = np.flatnonzero(is_decode), np.flatnonzero(~is_decode)
    views = packed.pack([query_start, context_lens, decode_seqs, prefill_seqs, layout.slot_mapping, tables])
    starts, lens, decodes, prefills, slots, flat_tables = views
    prefill_lens = layout.query_lens[prefill_seqs]
    return TritonAttentionMetadata(
        query_start=starts, seq_lens=lens, decode_seqs=decodes, prefill_seqs=prefills, slot_mapping=slots,
        block_tables=flat_tables.view(num_seqs, width), num_tokens=layout.num_tokens,
        max_prefill_len=int(prefill_lens.max()) if len(prefill_lens) else 0, decode_split=decode_split)
