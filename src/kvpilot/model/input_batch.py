"""InputBatch: the runner's persistent per-request state, one row per request it holds, updated from the
scheduler's diffs (kvpilot.engine.scheduler_output) instead of being rebuilt from live Request objects.

Rows are numpy arrays on the host (token ids, block table, counters, sampling settings), so a step's inputs
are gathered with vectorized indexing: host work per running request per step is O(1), independent of its
context and output length. Rows are recycled through a free list; a row's contents are valid only while a
request holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpilot.engine.scheduler_output import NewRequestData, RunningRequestData
from kvpilot.sampling_params import SamplingParams


class BatchFullError(RuntimeError):
    """More requests than max_num_seqs rows, or a request longer than max_model_len: a scheduler bug."""


@dataclass(frozen=True)
class BatchLimits:
    """Sizes of the persistent buffers."""

    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_kv_groups: int = 1  # engine/kv_groups.py: one block table per group

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


class InputBatch:
    """Invariants: `rows` maps each held request id to a distinct row in [0, max_num_seqs); for a held row r,
    token_ids[r, :num_tokens[r]] are its prompt then output tokens, of which the first num_known[r] are on
    the host and the rest placeholders (sampled by steps whose results are not committed yet: their ids are
    still on the device); block_table[r, :num_blocks[r]] is its block table; num_output[r] counts its
    outputs, placeholders included. With KV groups, extra_tables[g - 1, r, :num_blocks[r]] is group g's table
    (every group's table has num_blocks[r] entries)."""

    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        n, length = limits.max_num_seqs, limits.max_model_len
        # int32 like vLLM's (256 rows x 128k tokens is 128 MiB); +1: a finishing step samples past the end
        self.token_ids = np.zeros((n, length + 1), dtype=np.int32)
        self.num_tokens = np.zeros(n, dtype=np.int64)
        self.num_output = np.zeros(n, dtype=np.int64)
        self.num_known = np.zeros(n, dtype=np.int64)
        self.block_table = np.zeros((n, limits.max_blocks_per_seq), dtype=np.int64)
        self.extra_tables = np.zeros((limits.num_kv_groups - 1, n, limits.max_blocks_per_seq), dtype=np.int64)
        self.num_blocks = np.zeros(n, dtype=np.int64)
        self.num_computed = np.zeros(n, dtype=np.int64)  # before the current step, from the diff
        self.temperature = np.zeros(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)  # 0 = off
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.num_logprobs = np.full(n, -1, dtype=np.int64)  # -1: no logprobs
        self.params: list[SamplingParams | None] = [None] * n
        # never written: a decode step's query starts (and sampled rows), and its query lengths
        self.arange = np.arange(n, dtype=np.int64)
        self.ones = np.ones(n, dtype=np.int64)
        self.request_ids: list[str | None] = [None] * n
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(n - 1, -1, -1))
        # held rows that sample (temperature > 0), have min_tokens, want logprobs: a step whose rows have none of
        # these skips gathering those columns (host work per step independent of the batch)
        self.num_sampling = 0
        self.num_min_tokens = 0
        self.num_with_logprobs = 0
        # rows freed so far: while it stands still, every row still holds the request it held (commit's check)
        self.num_removed = 0
        # steps whose sampled ids are placeholders here, not committed yet: while 0, every token is known
        # (a step whose result is never read, after a failure, keeps it above 0: the general path, still right)
        self.num_steps_in_flight = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, new: NewRequestData) -> int:
        """Takes a row for a request new to the runner (admitted or resumed); returns the row."""
        if not self._free_rows:
            raise BatchFullError(f"more than max_num_seqs={self.limits.max_num_seqs} requests in the batch")
        tokens = [*new.prompt_token_ids, *new.output_token_ids]
        if len(tokens) > self.limits.max_model_len or len(new.block_ids) > self.limits.max_blocks_per_seq:
            raise BatchFullError(f"request {new.request_id!r} has {len(tokens)} tokens and "
                                 f"{len(new.block_ids)} blocks: over max_model_len={self.limits.max_model_len}")
        row = self._free_rows.pop()
        self.rows[new.request_id] = row
        self.request_ids[row] = new.request_id
        self.token_ids[row, :len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_output[row] = len(new.output_token_ids)
        self.num_known[row] = len(tokens)
        self.block_table[row, :len(new.block_ids)] = new.block_ids
        for table, ids in zip(self.extra_tables, new.extra_block_ids):
            table[row, :len(ids)] = ids
        self.num_blocks[row] = len(new.block_ids)
        self.num_computed[row] = new.num_computed_tokens
        self._set_params(row, new.sampling_params)
        return row

    def _set_params(self, row: int, params: SamplingParams) -> None:
        self.params[row] = params
        self.temperature[row] = params.temperature if not params.is_greedy else 0.0
        self.top_k[row] = params.top_k if params.top_k > 0 else 0
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = params.logprobs if params.logprobs is not None else -1
        self._count(row, 1)

    def _count(self, row: int, sign: int) -> None:
        self.num_sampling += sign * bool(self.temperature[row] > 0)
        self.num_min_tokens += sign * bool(self.min_tokens[row] > 0)
        self.num_with_logprobs += sign * bool(self.num_logprobs[row] >= 0)

    def update(self, running: Sequence[RunningRequestData]) -> np.ndarray:
        """Applies the running requests' diffs (new blocks, computed tokens), vectorized over the batch;
        returns their rows, in order."""
        rows = self.rows
        row_of: list[int] = []
        computed: list[int] = []
        for diff in running:  # one pass, into lists (2x two np.fromiter passes at 16 rows)
            row = rows[diff.request_id]
            row_of.append(row)
            computed.append(diff.num_computed_tokens)
            if diff.new_block_ids:  # a block boundary: a few requests a step
                self._append_blocks(row, diff)
        row_array = np.array(row_of, dtype=np.int64)
        self.num_computed[row_array] = computed
        return row_array

    def trim_blocks(self, trimmed: dict[str, int]) -> None:
        """Cuts held requests' block tables to the blocks the KV manager kept after rejected drafts
        (SchedulerOutput.trimmed_tables); ids not held are ignored."""
        for request_id, num_blocks in trimmed.items():
            row = self.rows.get(request_id)
            if row is not None:
                self.num_blocks[row] = min(int(self.num_blocks[row]), num_blocks)

    def _append_blocks(self, row: int, running: RunningRequestData) -> None:
        start = int(self.num_blocks[row])
        end = start + len(running.new_block_ids)
        if end > self.limits.max_blocks_per_seq:
            raise BatchFullError(f"request {running.request_id!r} has {end} blocks: over max_model_len")
        self.block_table[row, start:end] = running.new_block_ids
        for table, ids in zip(self.extra_tables, running.new_extra_block_ids):
            table[row, start:end] = ids
        self.num_blocks[row] = end

    def remove(self, request_id: str) -> int | None:
        """Frees the request's row (finished, aborted or preempted); unknown ids are ignored."""
        row = self.rows.pop(request_id, None)
        if row is not None:
            self._count(row, -1)
            self.temperature[row], self.min_tokens[row], self.num_logprobs[row] = 0.0, 0, -1
            self.request_ids[row] = None
            self.params[row] = None
            self._free_rows.append(row)
            self.num_removed += 1
        return row

    def write_drafts(self, row: int, drafts: Sequence[int]) -> None:
        """Puts a verification's drafts after the row's known tokens, where the step reads its input ids; they
        are not the row's tokens (num_tokens does not move) until append_verified accepts them."""
        start = int(self.num_tokens[row])
        if start + len(drafts) > self.token_ids.shape[1]:
            raise BatchFullError(f"request {self.request_ids[row]!r}: drafts past max_model_len")
        self.token_ids[row, start:start + len(drafts)] = drafts

    def append_verified(self, row: int, position: int, token_ids: Sequence[int]) -> None:
        """After commit() wrote a verification's first token at `position`: its further tokens (accepted
        drafts, then the target's own) follow it, all known on the host."""
        end = position + 1 + len(token_ids)
        self.token_ids[row, position + 1:end] = token_ids
        self.num_output[row] += end - int(self.num_tokens[row])
        self.num_tokens[row] = end
        self.num_known[row] = end

    def append_placeholders(self, rows: np.ndarray) -> np.ndarray:
        """A token was just sampled for each row (its id still on the device): counts advance now. Returns
        the positions the tokens take."""
        positions = self.num_tokens[rows]  # a fancy index: already a copy
        self.num_tokens[rows] = positions + 1
        self.num_output[rows] += 1
        self.num_steps_in_flight += 1
        return positions

    def commit(self, request_ids: Sequence[str], rows: np.ndarray, positions: np.ndarray,
               token_ids: Sequence[int] | np.ndarray, num_removed_at_launch: int | None = None) -> None:
        """The host now knows the ids of the tokens sampled into `positions` of `rows` for `request_ids` (as
        they were when the step launched, when num_removed was num_removed_at_launch; commits come in step
        order). A request finished, aborted or preempted since (its row gone, or taken by another request) is
        skipped: nothing to fill. With no row freed since the launch (the common case) none can be."""
        self.num_steps_in_flight = max(0, self.num_steps_in_flight - 1)
        if num_removed_at_launch is None or self.num_removed != num_removed_at_launch:
            live = self.rows
            now = np.fromiter((live.get(rid, -1) for rid in request_ids), dtype=np.int64, count=len(request_ids))
            keep = (now == rows) & (positions < self.num_tokens[rows])  # a resumed request may hold its old row
            if not keep.all():
                rows, positions = rows[keep], positions[keep]
                token_ids = np.asarray(token_ids, dtype=np.int64)[keep]
        self.token_ids[rows, positions] = token_ids
        self.num_known[rows] = positions + 1
