"""Engine settings for the KV cache and the scheduler, validated at construction.

The `LLM` keyword arguments and the server flags of the same names are checked through these classes, so
every message names the setting (vLLM spelling) and says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")
MAX_BLOCK_SIZE = 256


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks of size b that hold a tokens."""
    return -(-a // b)


class EngineConfigError(ValueError):
    """An engine setting is out of range; the message names the setting and the allowed values."""


def _require_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass: `max_num_seqs=True` is a bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise EngineConfigError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Paged KV cache shape.

    Invariants: block_size is a power of two in [1, 256] (tokens per block); num_blocks >= 1 (the whole
    pool; the cache holds num_blocks * block_size tokens); enable_prefix_caching turns hashing of full blocks
    and prefix reuse on or off; enable_kv_cache_events records the pool's cached-block changes (kv_events.py)
    for a publisher to drain.
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_kv_cache_events: bool = False

    def __post_init__(self) -> None:
        _require_int("block_size", self.block_size, 1)
        if self.block_size > MAX_BLOCK_SIZE or self.block_size & (self.block_size - 1):
            raise EngineConfigError(
                f"block_size must be a power of two between 1 and {MAX_BLOCK_SIZE} (16 is the usual choice), "
                f"got {self.block_size}"
            )
        _require_int("num_blocks", self.num_blocks, 1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise EngineConfigError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")

    @property
    def num_tokens(self) -> int:
        """How many tokens of KV the whole pool holds."""
        return self.num_blocks * self.block_size


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Per-step limits of the scheduler.

    Invariants: max_model_len >= 1 (prompt + max_tokens of one request); max_num_seqs >= 1 (requests in one
    step); max_num_batched_tokens >= max_num_seqs (token budget of one step, so every running request can
    always decode); scheduling_policy is "fcfs" (arrival order) or "priority" (lower integer first).
    """

    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        _require_int("max_model_len", self.max_model_len, 1)
        _require_int("max_num_seqs", self.max_num_seqs, 1)
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode each step: raise "
                f"max_num_batched_tokens or lower max_num_seqs"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise EngineConfigError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )


def check_model_len_fits(scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
    """Raise unless one request of max_model_len tokens fits in the whole KV cache."""
    capacity = cache_config.num_tokens
    if scheduler_config.max_model_len > capacity:
        raise EngineConfigError(
            f"max_model_len ({scheduler_config.max_model_len}) does not fit in the KV cache of "
            f"{cache_config.num_blocks} blocks x {cache_config.block_size} tokens = {capacity} tokens: "
            f"the largest max_model_len that fits is {capacity}; lower max_model_len or give the cache more memory"
        )
