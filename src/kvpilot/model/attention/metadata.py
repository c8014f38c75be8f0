"""AttentionMetadata: how the flattened tokens of one step map onto sequences and KV cache slots.

Built once per step by an attention backend from the step's StepLayout and shared by every layer (no hidden
globals).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence computing several tokens this step (a prompt or a chunk of it).

    Invariants: rows query_start..query_start+query_len-1 of the flattened batch belong to it; its keys are
    positions 0..context_len-1, of which the last query_len are the queries themselves
    (context_len = start_position + query_len). `mask` is None when start_position == 0 (plain causal).
    """

    query_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor  # [num_blocks_of_seq] long
    mask: torch.Tensor | None  # [query_len, context_len] bool, True = may attend


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences computing exactly one token this step, attended together (one kernel call or batched matmul).

    Invariants: token_rows[b] is the row of sequence b in the flattened batch; block_tables is padded with
    block 0 (masked out by key_bias, which is 0 for positions < context_lens[b] and -inf beyond). key_bias
    is None when the C++ decode kernel runs the batch: it stops at context_lens itself. row_range is
    (token_rows[0], token_rows[-1] + 1) when the rows are consecutive (then a slice replaces gather/scatter).
    """

    token_rows: torch.Tensor  # [B] long
    row_range: tuple[int, int] | None
    block_tables: torch.Tensor  # [B, max_blocks] long
    context_lens: torch.Tensor  # [B] long: keys 0..context_lens[b]-1 (the new token included)
    key_bias: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] float32

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """This batch's rows of a per-token tensor: a view when they are consecutive, else a gathered copy."""
        return x[self.row_range[0]: self.row_range[1]] if self.row_range is not None else x[self.token_rows]


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs: where to write each token's K/V and how each sequence reads its KV."""

    slot_mapping: torch.Tensor  # [T] long: cache slot of each token (block_id * block_size + offset)
    prefills: list[PrefillSeq]
    decodes: list[DecodeBatch]  # one batch, or groups of similar context length
    num_tokens: int


def make_key_bias(context_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, 1, 1, num_keys] float32: 0 for key positions < context_lens[b], -inf beyond (padding)."""
    key_pos = torch.arange(num_keys, device=context_lens.device)[None, :]
    bias = torch.zeros(len(context_lens), num_keys, dtype=torch.float32, device=context_lens.device)
    bias.masked_fill_(key_pos >= context_lens[:, None], float("-inf"))
    return bias[:, None, None, :]


def host_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 tensor of `array` on `device`: on a CPU it shares the array's memory (no copy, no `.to`)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    return tensor if device.type == "cpu" else tensor.to(device)


def make_decode_batch(block_tables: np.ndarray, context_lens: np.ndarray, token_rows: np.ndarray,
                      block_size: int, device: torch.device, with_bias: bool = True,
                      consecutive: bool | None = None, max_blocks: int | None = None) -> DecodeBatch:
    """From host arrays: block_tables [B, >= max blocks needed] (padding beyond a sequence's blocks is never
    read), context_lens [B] (keys including the new token), token_rows [B]; `consecutive`: whether token_rows
    are first, first + 1, ... (None: checked here); max_blocks: the table columns to take (None: as many as
    the longest context needs)."""
    if max_blocks is None:
        max_blocks = int(-(-context_lens.max() // block_size))
    tables = host_tensor(block_tables[:, :max_blocks], device)
    lens = host_tensor(context_lens, device)
    bias = make_key_bias(lens, max_blocks * block_size) if with_bias else None
    first = int(token_rows[0])
    if consecutive is None:
        consecutive = bool(np.array_equal(token_rows, np.arange(first, first + len(token_rows))))
    return DecodeBatch(token_rows=host_tensor(token_rows, device),
                       row_range=(first, first + len(token_rows)) if consecutive else None,
                       block_tables=tables, context_lens=lens, key_bias=bias)
