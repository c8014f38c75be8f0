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
    for a publisher to drain. sliding_window is None, or W >= 1 when EVERY layer of the model attends only to
    the last W keys (a query at position p reads keys j with p - W < j <= p): the KV manager then releases a
    request's blocks that lie wholly before that window (kv_manager.py). An interleaved model (Gemma 2/3,
    gpt-oss: engine/kv_groups.py) has several KV groups: sliding_window is group 0's window and
    extra_group_windows those of groups 1.., each group with its own block table per request over the one
    pool, so a sliding group's blocks are freed while a full group keeps its own.

    KV offload (kv_offload.py): num_offload_blocks > 0 keeps evicted prefix blocks in a host-memory tier of that
    many blocks, num_disk_offload_blocks > 0 in a local-disk tier below it (only with a host tier). Both need
    prefix caching (a tier is keyed by block hashes); the KV manager ignores them under a sliding window or
    several groups.
    overlap_offload_loads: a waiting request's tier blocks are loaded beside a step of the running requests
    (kv_manager.py's prefetch), the request admitted at the step after; False, or with nothing running: loaded
    before the forward of the request's own first step, lengthening it. pace_offload_loads: such a load takes
    at most the blocks whose copy hides behind one step, over as many steps as it needs (load_pacing.py; CPU
    engines, where the step waits for the copy).
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_kv_cache_events: bool = False
    sliding_window: int | None = None
    extra_group_windows: tuple[int | None, ...] = ()
    num_offload_blocks: int = 0
    num_disk_offload_blocks: int = 0
    overlap_offload_loads: bool = True
    pace_offload_loads: bool = False

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
        for window in (self.sliding_window, *self.extra_group_windows):
            if window is not None:
                _require_int("sliding_window", window, 1)
        _require_int("num_offload_blocks", self.num_offload_blocks, 0)
        _require_int("num_disk_offload_blocks", self.num_disk_offload_blocks, 0)
        if self.num_disk_offload_blocks and not self.num_offload_blocks:
            raise EngineConfigError("a disk offload tier sits below the host tier: give kv_offloading_size too")
        if self.num_offload_blocks and not self.enable_prefix_caching:
            raise EngineConfigError("KV offload keeps prefix blocks by their hashes: it needs prefix caching "
                                    "(drop --no-enable-prefix-caching, or kv_offloading_size)")

    @property
    def offload_enabled(self) -> bool:
        """Whether evicted prefix blocks go to an offload tier (never under a sliding window or with several
        KV groups: kv_manager.py)."""
        return self.num_offload_blocks > 0 and self.enable_prefix_caching and self.sliding_window is None \
            and not self.extra_group_windows

    @property
    def num_groups(self) -> int:
        return 1 + len(self.extra_group_windows)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """The window of each KV group (None: full attention); one entry unless the model is interleaved."""
        return (self.sliding_window, *self.extra_group_windows)

    @property
    def num_tokens(self) -> int:
        """How many tokens of KV the whole pool holds."""
        return self.num_blocks * self.block_size

    def max_blocks_per_request(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks one request of num_tokens KV tokens holds at once when chunks are at most
        max_chunk_tokens long, summed over its KV groups: in each, all of them, or with a sliding window those
        of the window before a chunk's first token plus the chunk's own (cdiv(W - 1 + chunk, block_size) + 1:
        the window may start mid-block), whichever is fewer."""
        whole = cdiv(num_tokens, self.block_size)
        return sum(whole if window is None else min(whole, cdiv(window - 1 + max_chunk_tokens, self.block_size) + 1)
                   for window in self.group_windows)


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
    """Raise unless one request of max_model_len tokens fits in the whole KV cache (with a sliding window:
    the blocks it holds at once, CacheConfig.max_blocks_per_request)."""
    capacity = cache_config.num_tokens
    fits = largest_model_len(cache_config, scheduler_config.max_num_batched_tokens, scheduler_config.max_model_len)
    if fits < scheduler_config.max_model_len:
        raise EngineConfigError(
            f"max_model_len ({scheduler_config.max_model_len}) does not fit in the KV cache of "
            f"{cache_config.num_blocks} blocks x {cache_config.block_size} tokens = {capacity} tokens"
            f"{'' if cache_config.num_groups == 1 else f' over {cache_config.num_groups} KV groups'}: the largest "
            f"max_model_len that fits is {fits}; lower max_model_len or give the cache more memory"
        )


def largest_model_len(cache_config: CacheConfig, max_chunk_tokens: int, upper: int) -> int:
    """The longest request, at most `upper` tokens, whose blocks (CacheConfig.max_blocks_per_request, over every
    KV group) fit in the whole cache at once; 0 when not even one token's do."""
    if cache_config.max_blocks_per_request(upper, max_chunk_tokens) <= cache_config.num_blocks:
        return upper
    # the blocks held grow with the length (by one a group at each block boundary): bisect over it
    low, high = 0, upper  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if cache_config.max_blocks_per_request(mid, max_chunk_tokens) <= \
            cache_config.num_blocks else (low, mid)
    return low
