"""The Triton backend's per-step metadata, packed into one persistent int32 buffer on the device.

Every step's integer inputs (query starts, context lengths, which sequences decode and which prefill, the
slot mapping, the block tables) are written into one host staging array and sent with one copy into one
device buffer, of which the metadata tensors are views. The buffers grow (to the next power of two) when a
step needs more, and can be reserved up front for max_num_seqs x max blocks: then a decode step of a fixed
batch size and table width always lands at the same device addresses, which is what a captured CUDA graph
needs. Host staging is pinned and double-buffered on CUDA, so a step's copy is asynchronous and the next
step cannot overwrite bytes still in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.triton_split import DecodeSplit


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


class MetadataOverflowError(RuntimeError):
    """A step outgrew the metadata buffer that captured CUDA graphs read."""


class PackedInts:
    """One growable int32 device buffer filled from pinned host staging by a single copy a step."""

    def __init__(self, device: torch.device, capacity: int = 0) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._staging: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._turn = 0
        self._frozen = False
        self.buffer = torch.empty(0, dtype=torch.int32, device=device)
        self.reserve(capacity)

    def freeze(self) -> None:
        """From now on the device buffer never moves (captured CUDA graphs hold its address)."""
        self._frozen = True

    def reserve(self, num_ints: int) -> None:
        """Makes room for num_ints (rounded up to a power of two); no-op when it fits already.
        MetadataOverflowError once frozen: the graphs would read a freed buffer."""
        if num_ints <= self.buffer.numel():
            return
        if self._frozen:
            raise MetadataOverflowError(
                f"a step needs {num_ints} metadata ints but {self.buffer.numel()} were reserved before the "
                "CUDA graphs were captured: a runner bug (reserve for max_num_seqs, the token budget and "
                "max_model_len); --enforce-eager avoids it")
        size = 1 << max(num_ints - 1, 1).bit_length()
        self.buffer = torch.empty(size, dtype=torch.int32, device=self.device)
        copies = 2 if self._pinned else 1
        self._staging = [torch.empty(size, dtype=torch.int32, pin_memory=self._pinned) for _ in range(copies)]
        self._events = [None] * copies

    def pack(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device int32 views holding `arrays`, back to back in order (equal sizes -> equal addresses)."""
        total = sum(int(a.size) for a in arrays)
        self.reserve(total)
        turn = self._turn
        self._turn = (turn + 1) % len(self._staging)
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # the copy that last read this staging buffer (normally long finished)
        host = self._staging[turn].numpy()
        offset, spans = 0, []
        for array in arrays:
            host[offset: offset + array.size] = array.ravel()
            spans.append((offset, array.size))
            offset += array.size
        self.buffer[:total].copy_(self._staging[turn][:total], non_blocking=self._pinned)
        if self._pinned:
            event = torch.cuda.Event()
            event.record()
            self._events[turn] = event
        return [self.buffer[o: o + n] for o, n in spans]


def pack_layout(layout: StepLayout, packed: PackedInts, decode_split: DecodeSplit,
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
