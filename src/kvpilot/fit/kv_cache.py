"""KV-cache sizes: bytes per token for any architecture, and the paged-cache contract the engine uses.

Per token and layer, standard attention stores K and V for every KV head:
    2 * num_key_value_heads * head_dim * dtype_bytes
Multi-head Latent Attention (DeepSeek-V2/V3) stores one compressed latent plus the shared RoPE key:
    (kv_lora_rank + qk_rope_head_dim) * dtype_bytes          (as vLLM's MLA backends do)
Sliding-window layers keep at most `sliding_window` tokens per sequence.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from kvpilot.fit.model_spec import ModelSpec


class KvShape(Protocol):
    """What the paged cache needs to know; both ModelSpec and the engine's ModelConfig satisfy it."""

    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def kv_cache_bytes_per_block(spec: KvShape, block_size: int, kv_dtype_bytes: int,
                             num_cache_layers: int | None = None) -> int:
    """Bytes of one block in the engine's cache, which holds K and V for every layer (per layer
    [2, num_key_value_heads, num_blocks, block_size, head_dim]): 2 * layers * block * heads * dim * bytes.
    An interleaved model's block serves one KV group (engine/kv_groups.py): num_cache_layers is then the
    group size, the layers' cache tensors (None: every layer)."""
    if block_size <= 0 or kv_dtype_bytes <= 0:
        raise ValueError(f"block_size ({block_size}) and kv_dtype_bytes ({kv_dtype_bytes}) must be positive")
    layers = spec.num_hidden_layers if num_cache_layers is None else num_cache_layers
    return 2 * layers * block_size * spec.num_key_value_heads * spec.head_dim * kv_dtype_bytes


def num_kv_blocks_for_memory(spec: KvShape, memory_bytes: int, block_size: int, kv_dtype_bytes: int,
                             num_cache_layers: int | None = None) -> int:
    """Whole blocks that fit in `memory_bytes` (0 when the budget is negative or smaller than a block)."""
    return max(0, memory_bytes // kv_cache_bytes_per_block(spec, block_size, kv_dtype_bytes, num_cache_layers))


def window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks a decoding request holds when every layer slides over `sliding_window` tokens: those the next
    query reads (the window may start mid-block) - the engine's KV manager releases the rest."""
    return math.ceil((sliding_window - 1) / block_size) + 1


def blocks_held(num_tokens: int, block_size: int, group_windows: tuple[int | None, ...] = (None,)) -> int:
    """Blocks a decoding request of num_tokens KV tokens holds, summed over the engine's KV groups (their
    windows, None: full attention): all its blocks in a full group, at most window_blocks in a sliding one."""
    whole = math.ceil(num_tokens / block_size)
    return sum(whole if w is None else min(whole, window_blocks(w, block_size)) for w in group_windows)


@dataclass(frozen=True)
class KvCapacity:
    """The engine's KV capacity, predicted (by `fit`) or actual (reported by a running server).

    Invariant: num_tokens == num_blocks * block_size; max_concurrency = num_blocks / the blocks one request
    of max_model_len holds, summed over its KV groups (sliding_window: group 0's window, set when every layer
    slides; extra_group_windows: an interleaved model's groups 1..): in each, all its tokens', or with a window
    at most window_blocks.
    """

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    sliding_window: int | None = None
    extra_group_windows: tuple[int | None, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit at once (vLLM's "Maximum concurrency" figure)."""
        return self.num_blocks / blocks_held(self.max_model_len, self.block_size, self.group_windows)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return (self.sliding_window, *self.extra_group_windows)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "num_tokens": self.num_tokens, "num_bytes": self.num_bytes,
                "max_concurrency": round(self.max_concurrency, 4)}


def kv_capacity_for_memory(
    spec: KvShape, memory_bytes: int, block_size: int, kv_dtype_bytes: int, max_model_len: int,
    sliding_window: int | None = None, extra_group_windows: tuple[int | None, ...] = (),
    num_cache_layers: int | None = None,
) -> KvCapacity:
    """The capacity the engine gets from a KV memory budget (same arithmetic the engine allocates with):
    sliding_window, extra_group_windows and num_cache_layers as the engine's KV group plan has them
    (engine/kv_groups.py; by default one group over every layer, no window)."""
    return KvCapacity(
        num_blocks=num_kv_blocks_for_memory(spec, memory_bytes, block_size, kv_dtype_bytes, num_cache_layers),
        block_size=block_size,
        bytes_per_block=kv_cache_bytes_per_block(spec, block_size, kv_dtype_bytes, num_cache_layers),
        max_model_len=max_model_len,
        sliding_window=sliding_window,
        extra_group_windows=extra_group_windows,
    )


def format_capacity_line(capacity: KvCapacity) -> str:
    """One start-up line, e.g. 'KV cache: 1,234 blocks x 16 = 19,744 tokens (1.13 GiB); maximum
    concurrency for 8,192 tokens per request: 2.41x'."""
    window = "" if capacity.sliding_window is None else f" (sliding window of {capacity.sliding_window:,})"
    if capacity.extra_group_windows:
        window = f" ({1 + len(capacity.extra_group_windows)} KV groups: windows " + \
            ", ".join("full" if w is None else f"{w:,}" for w in capacity.group_windows) + ")"
    return (
        f"KV cache: {capacity.num_blocks:,} blocks x {capacity.block_size} = {format_token_slots(capacity)} "
        f"({capacity.num_bytes / 2**30:.2f} GiB); maximum concurrency for {capacity.max_model_len:,} "
        f"tokens per request{window}: {capacity.max_concurrency:.2f}x"
    )


def format_token_slots(capacity: KvCapacity) -> str:
    """"19,744 tokens"; with KV groups "19,744 token slots over 3 KV groups": a block holds one group's layers,
    so a token no window has dropped takes a slot in each group."""
    groups = len(capacity.group_windows)
    return f"{capacity.num_tokens:,} tokens" if groups == 1 else \
        f"{capacity.num_tokens:,} token slots over {groups} KV groups"


# ---- any architecture (fit's own model): MLA, sliding windows, tensor parallelism ----


def kv_heads_per_gpu(spec: ModelSpec, tensor_parallel_size: int) -> int:
    """KV heads stored on each GPU; vLLM replicates KV heads when TP exceeds their number."""
    return max(1, spec.num_key_value_heads // tensor_parallel_size)


def kv_bytes_per_token_per_layer(spec: ModelSpec, kv_dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """Bytes one token adds to one layer's cache on one GPU (the MLA latent is replicated, not split)."""
    if spec.mla is not None:
        return (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * kv_dtype_bytes
    return 2 * kv_heads_per_gpu(spec, tensor_parallel_size) * spec.head_dim * kv_dtype_bytes


def kv_bytes_per_token(spec: ModelSpec, kv_dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """Bytes per token over all layers on one GPU, ignoring sliding windows (the headline figure)."""
    return spec.num_hidden_layers * kv_bytes_per_token_per_layer(spec, kv_dtype_bytes, tensor_parallel_size)


def kv_bytes_per_sequence(
    spec: ModelSpec, num_tokens: int, kv_dtype_bytes: int, tensor_parallel_size: int = 1, block_size: int = 1
) -> int:
    """Cache bytes of one sequence of `num_tokens` on one GPU, rounded up to whole blocks, as kvpilot's engine
    holds them: when every layer slides, at most the window (plus one block, as a paged cache frees whole
    blocks); an interleaved model (Gemma 2/3, gpt-oss) keeps the whole context in its full layers and the
    window in its sliding ones, as the engine's KV groups do (engine/kv_groups.py; ignoring the unused slots
    of a short last group)."""
    per_layer = kv_bytes_per_token_per_layer(spec, kv_dtype_bytes, tensor_parallel_size)
    tokens = math.ceil(num_tokens / block_size) * block_size
    if not spec.sliding_window:
        return spec.num_hidden_layers * tokens * per_layer
    windowed = min(tokens, window_blocks(spec.sliding_window, block_size) * block_size)
    num_full = spec.num_hidden_layers - spec.num_sliding_layers
    return (num_full * tokens + spec.num_sliding_layers * windowed) * per_layer
