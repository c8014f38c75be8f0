"""One step's flattened model inputs, gathered from the persistent batch with vectorized numpy indexing.

Token i of a chunk has position start_position + i and is stored in slot
block_table[row, pos // block_size] * block_size + pos % block_size. A token whose id the host does not know
yet (sampled by the previous step, result not read: async scheduling) is taken on the device from that
step's sampled ids, so the step can be built and launched before the previous one's tokens are back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvpilot.engine.scheduler_output import ScheduledChunk
from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.metadata import host_tensor
from kvpilot.model.device_staging import PackedArrays
from kvpilot.model.input_batch import InputBatch


_NONE = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class PreviousSample:
    """The last step's sampled ids on the device; token_ids[i] was sampled for persistent row rows[i]."""

    token_ids: torch.Tensor  # [N] long
    rows: np.ndarray  # [N] int64, distinct

    def index_of(self, rows: np.ndarray) -> np.ndarray:
        """Each of `rows`' index into token_ids, -1 where the last step sampled nothing for it. Built only
        when a step reads tokens still on the device (async scheduling), not on every step."""
        lookup = np.full(max(int(self.rows.max(initial=-1)), int(rows.max(initial=-1))) + 1, -1, dtype=np.int64)
        lookup[self.rows] = np.arange(len(self.rows))
        return lookup[rows]


@dataclass(frozen=True)
class StepInputs:
    """Invariant: sample_rows[i] is the last flattened row of the i-th chunk with needs_sample, whose request
    is sample_request_ids[i] at persistent row sample_batch_rows[i]. With drafts to verify (sample_counts set,
    model/verify_inputs.py) chunk i samples sample_counts[i] consecutive rows of sample_rows instead: its
    last known token's, then each draft's."""

    token_ids: torch.Tensor  # [T] int64 (CPU) or int32 (CUDA: staged), on the device
    positions: torch.Tensor  # [T], the same dtype
    layout: StepLayout
    sample_rows: torch.Tensor  # [N] (with sample_counts: [sum(sample_counts)]), the same dtype
    sample_request_ids: list[str]
    sample_batch_rows: np.ndarray  # [N] int64
    sample_counts: np.ndarray | None = None  # [N] int64, >= 1

    @property
    def logit_batch_rows(self) -> np.ndarray:
        """The persistent row of each sampled row (sample_batch_rows, each repeated sample_counts times)."""
        if self.sample_counts is None:
            return self.sample_batch_rows
        return np.repeat(self.sample_batch_rows, self.sample_counts)


class MissingTokenError(RuntimeError):
    """A step reads a token that neither the host nor the previous step has: a scheduler/runner bug."""


def _previous_sources(unknown: np.ndarray, token_rows: np.ndarray, previous: PreviousSample | None) -> np.ndarray:
    """For each unknown input token, its index into the previous step's sampled ids."""
    if len(unknown) == 0:
        return unknown
    source = previous.index_of(token_rows[unknown]) if previous is not None else np.full(len(unknown), -1)
    if (source < 0).any():
        raise MissingTokenError(f"{int((source < 0).sum())} input tokens were not sampled by the previous step")
    return source


def _to_device(arrays: list[np.ndarray], staging: PackedArrays | None, device: torch.device) -> list[torch.Tensor]:
    """int64 tensors sharing the arrays' memory (staging None: a CPU step), or int32 views of one
    asynchronous copy (a CUDA step: no wait for the kernels queued before it)."""
    if staging is None:
        return [host_tensor(a, device) for a in arrays]
    return staging.pack(arrays)


def build_step_inputs(batch: InputBatch, chunks: Sequence[ScheduledChunk], rows: np.ndarray,
                      previous: PreviousSample | None, device: torch.device,
                      staging: PackedArrays | None = None, *, decodes: bool = False) -> StepInputs:
    """Flattens the chunks in their given order; `rows` are their persistent rows (same order). `staging`:
    how the integer inputs travel to a CUDA device without a sync (None: plain copies). decodes: the caller
    knows every chunk is a decode (one sampled token after earlier ones: the scheduler's counts say so), so
    the step takes the shortest path, with no pass over the chunks to find out."""
    if decodes:
        return _decode_inputs(batch, chunks, rows, previous, device, staging)
    num_chunks = len(chunks)
    # one pass over the chunks: each gives 2 * num_tokens + needs_sample (this runs for every request every step)
    packed = np.fromiter((2 * c.num_tokens + c.needs_sample for c in chunks), dtype=np.int64, count=num_chunks)
    query_lens, samples = packed >> 1, (packed & 1).astype(bool)
    flat = flatten_step(batch, rows, batch.num_computed[rows], query_lens, samples, previous, device, staging)
    if flat.sampled is None:  # every chunk samples (decode steps, whole prompts)
        sample_request_ids, sample_batch_rows = [c.request_id for c in chunks], rows
    else:
        sample_request_ids = [chunks[i].request_id for i in flat.sampled.tolist()]
        sample_batch_rows = rows[flat.sampled]
    return StepInputs(token_ids=flat.token_ids, positions=flat.positions, layout=flat.layout,
                      sample_rows=flat.sample_rows, sample_request_ids=sample_request_ids,
                      sample_batch_rows=sample_batch_rows)


@dataclass(frozen=True)
class FlatStep:
    """flatten_step's result: the device inputs, the layout, and which sequences sample (None: all)."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    sample_rows: torch.Tensor
    layout: StepLayout
    sampled: np.ndarray | None


def flatten_step(batch: InputBatch, rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray,
                 samples: np.ndarray, previous: PreviousSample | None, device: torch.device,
                 staging: PackedArrays | None, all_known: bool = False) -> FlatStep:
    """Sequence i computes query_lens[i] tokens of persistent row rows[i] from position starts[i] and, when
    samples[i], samples at its last one. Rows may repeat (verify_inputs.py: one sequence per draft).
    all_known: the caller knows every input id is on the host (drafts sit past a row's known tokens)."""
    block_size = batch.limits.block_size
    num_seqs = len(rows)
    if int(query_lens.sum()) == num_seqs:  # one token per sequence (a decode step): nothing to repeat
        query_start = np.arange(num_seqs, dtype=np.int64)
        ends, token_rows, positions = query_start + 1, rows, starts
    else:
        ends = np.cumsum(query_lens)
        query_start = ends - query_lens
        token_rows = np.repeat(rows, query_lens)
        positions = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(starts - query_start, query_lens)
    sampled = None if samples.all() else np.flatnonzero(samples)
    block_index, offset = np.divmod(positions, block_size)
    slots = batch.block_table[token_rows, block_index] * block_size + offset
    integers = [batch.token_ids[token_rows, positions], positions, ends - 1 if sampled is None else ends[sampled] - 1]
    token_ids, positions_t, sample_rows = _integer_inputs(batch, integers, token_rows, previous, staging, device,
                                                          all_known)
    max_blocks = int(-(-(starts + query_lens).max() // block_size))
    layout = StepLayout(query_start=query_start, query_lens=query_lens, start_positions=starts,
                        block_tables=batch.block_table[rows, :max_blocks], slot_mapping=slots, block_size=block_size,
                        extra_groups=_extra_groups(batch, rows, token_rows, block_index, offset, max_blocks))
    return FlatStep(token_ids, positions_t, sample_rows, layout, sampled)


def _decode_inputs(batch: InputBatch, chunks: Sequence[ScheduledChunk], rows: np.ndarray,
                   previous: PreviousSample | None, device: torch.device,
                   staging: PackedArrays | None) -> StepInputs:
    """A decode step's inputs (build_step_inputs' general path gives the same): token i is chunk i's, at its
    request's next position, and is sampled row i. The fewest numpy calls: each costs ~1 us, and more when
    the forward before has pushed numpy's code and data out of the CPU caches."""
    block_size = batch.limits.block_size
    num_seqs = len(rows)
    positions = batch.num_computed[rows]
    query_start = batch.arange[:num_seqs]  # shared by every step, never written
    block_index, offset = np.divmod(positions, block_size)
    slots = batch.block_table[rows, block_index] * block_size + offset
    max_blocks = int(block_index.max()) + 1
    tables = batch.block_table[rows, :max_blocks]
    integers = [batch.token_ids[rows, positions], positions, query_start]
    token_ids, positions_t, sample_rows = _integer_inputs(batch, integers, rows, previous, staging, device)
    layout = StepLayout.of_decodes(query_start, batch.ones[:num_seqs], positions, tables, slots, block_size,
                                   _extra_groups(batch, rows, rows, block_index, offset, max_blocks))
    return StepInputs(token_ids=token_ids, positions=positions_t, layout=layout, sample_rows=sample_rows,
                      sample_request_ids=[c.request_id for c in chunks], sample_batch_rows=rows)


def _extra_groups(batch: InputBatch, rows: np.ndarray, token_rows: np.ndarray, block_index: np.ndarray,
                  offset: np.ndarray, max_blocks: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """StepLayout.extra_groups: KV groups 1..'s block tables and slots for the same tokens (() with one group)."""
    block_size = batch.limits.block_size
    return tuple((tables[rows, :max_blocks], tables[token_rows, block_index] * block_size + offset)
                 for tables in batch.extra_tables)


def _integer_inputs(batch: InputBatch, integers: list[np.ndarray], token_rows: np.ndarray,
                    previous: PreviousSample | None, staging: PackedArrays | None,
                    device: torch.device, all_known: bool = False) -> list[torch.Tensor]:
    """`integers` (token ids, positions, sample rows) on the device; a token whose id is still on the device
    (sampled by the previous step, not yet read back under async scheduling) taken from there."""
    positions = integers[1]
    # tokens sampled by a step whose ids are not committed yet; none while no step is in flight
    unknown = np.flatnonzero(positions >= batch.num_known[token_rows]) \
        if batch.num_steps_in_flight and not all_known else _NONE
    if len(unknown):
        integers = [*integers, unknown, _previous_sources(unknown, token_rows, previous)]
    token_ids, positions_t, sample_rows, *from_previous = _to_device(integers, staging, device)
    if from_previous and previous is not None:  # (no previous: _previous_sources raised)
        unknown_t, source_t = from_previous
        token_ids[unknown_t] = previous.token_ids[source_t].to(token_ids.dtype)
    return [token_ids, positions_t, sample_rows]
