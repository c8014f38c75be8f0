"""StepLayout: a backend-neutral description of one step's flattened batch, as host (numpy) arrays.

The runner builds it with vectorized ops from its persistent batch; each attention backend turns it into
its own metadata. Per-sequence arrays are in step order (the order of the scheduler's chunks).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class StepLayout:
    """Invariants: query_start[i] = sum(query_lens[:i]); context_lens[i] = start_positions[i] + query_lens[i];
    block_tables[i, :ceil(context_lens[i] / block_size)] is sequence i's block table (later columns are
    padding that must not be read unmasked); slot_mapping[t] is token t's cache slot. extra_groups: with KV
    groups (engine/kv_groups.py), the (block_tables, slot_mapping) of groups 1.., shaped as group 0's;
    for_group(g) is the layout a backend builds group g's metadata from."""

    query_start: np.ndarray  # [S] int64
    query_lens: np.ndarray  # [S] int64
    start_positions: np.ndarray  # [S] int64: computed tokens before the step
    block_tables: np.ndarray  # [S, widest table of the step] int64 (from the persistent table)
    slot_mapping: np.ndarray  # [T] int64
    block_size: int
    extra_groups: tuple[tuple[np.ndarray, np.ndarray], ...] = ()

    # Derived arrays are computed once per step (the backend, CUDA graphs and the runner each read them);
    # treat them as read-only like the rest.
    @cached_property
    def context_lens(self) -> np.ndarray:
        return self.start_positions + self.query_lens

    @cached_property
    def is_decode(self) -> np.ndarray:
        """One token after earlier ones (kvpilot.engine.scheduler_output.ScheduledChunk.is_decode)."""
        return (self.query_lens == 1) & (self.start_positions > 0)

    @cached_property
    def all_decode(self) -> bool:
        """Every sequence of the step is a decode."""
        return bool(self.is_decode.all())

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_groups(self) -> int:
        return 1 + len(self.extra_groups)

    def for_group(self, group: int) -> "StepLayout":
        """The layout of KV group `group` (0: this one): its block tables and slots, the same sequences."""
        if group == 0:
            return self
        tables, slots = self.extra_groups[group - 1]
        layout = StepLayout(query_start=self.query_start, query_lens=self.query_lens,
                            start_positions=self.start_positions, block_tables=tables, slot_mapping=slots,
                            block_size=self.block_size)
        derived = ("context_lens", "is_decode", "all_decode")  # cached: the same for every group
        layout.__dict__.update({name: self.__dict__[name] for name in derived if name in self.__dict__})
        return layout

    @classmethod
    def of_decodes(cls, query_start: np.ndarray, query_lens: np.ndarray, start_positions: np.ndarray,
                   block_tables: np.ndarray, slot_mapping: np.ndarray, block_size: int,
                   extra_groups: tuple[tuple[np.ndarray, np.ndarray], ...] = ()) -> "StepLayout":
        """A step of decodes only (one token each after earlier ones: query_start is 0..S-1, query_lens all 1,
        every start position > 0, as the caller knows), with the derived context_lens and all_decode set here
        rather than computed again from the arrays."""
        layout = cls(query_start=query_start, query_lens=query_lens, start_positions=start_positions,
                     block_tables=block_tables, slot_mapping=slot_mapping, block_size=block_size,
                     extra_groups=extra_groups)
        # where cached_property keeps its values: the frozen dataclass's __setattr__ is not involved
        layout.__dict__.update(context_lens=start_positions + 1, all_decode=True)
        return layout
