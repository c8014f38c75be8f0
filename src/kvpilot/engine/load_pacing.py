"""LoadPacer: how many offload-tier blocks a prefetch may load beside one step (issue #49, kv_manager.py).

On a CPU the runner copies a prefetch's blocks in a thread beside the step's forward and waits for the copy
before the step returns, so a copy longer than the forward lengthens the step of every running request (their
inter-token gap) by the difference. A returning session of thousands of tokens is many such steps' worth of
copy. The pacer spreads it: a prefetch takes at most max_blocks() tier blocks a step, and the request takes
further rounds in the next steps (kv_manager.can_prefetch), until its whole hit is in the pool.

The cost model: the runner reports each step's beside copy (seconds, blocks) and the engine each step's wall
time. `seconds_per_block` is an exponential average of the copies' seconds per block, `step_seconds` one of
the wall time of steps without beside loads (what a copy can hide behind); max_blocks() is the blocks whose copy
takes HIDE_SHARE of a step (at least one, so every prefetch progresses), but never fewer than a MAX_ROUNDS-th of
the request's first round's tier blocks: the returning request waits a round's step each time, so its TTFT
grows by at most about MAX_ROUNDS steps. Until a copy and a step were measured, a round takes
FIRST_ROUND_BLOCKS, which measures them. Only CPU engines pace (CacheConfig.pace_offload_loads):
on CUDA the loads run on a side stream the host does not wait for, and one round takes every tier block.
"""

from __future__ import annotations

from dataclasses import dataclass

HIDE_SHARE = 0.8  # of a step's time a beside copy may take (the rest: the copy thread's start and join)
FIRST_ROUND_BLOCKS = 8
MAX_ROUNDS = 4
SMOOTHING = 0.3  # weight of the newest observation in each average


@dataclass
class LoadPacer:
    """Invariants: seconds_per_block and step_seconds are None until observed, then > 0; max_blocks() >= 1."""

    seconds_per_block: float | None = None
    step_seconds: float | None = None

    def observe(self, step_seconds: float, beside_seconds: float, num_beside_blocks: int) -> None:
        """A finished step: its wall time, and what its beside loads (if any) took."""
        if num_beside_blocks:
            if beside_seconds > 0:
                self.seconds_per_block = _average(self.seconds_per_block, beside_seconds / num_beside_blocks)
        elif step_seconds > 0:
            self.step_seconds = _average(self.step_seconds, step_seconds)

    def max_blocks(self, num_first_round: int = 0) -> int:
        """The tier blocks the next prefetch round of a request may load; num_first_round: its tier blocks when
        its first round began."""
        floor = -(-num_first_round // MAX_ROUNDS)
        if self.seconds_per_block is None or self.step_seconds is None:
            return max(FIRST_ROUND_BLOCKS, floor)
        return max(1, floor, int(HIDE_SHARE * self.step_seconds / self.seconds_per_block))


def _average(current: float | None, value: float) -> float:
    return value if current is None else (1 - SMOOTHING) * current + SMOOTHING * value
