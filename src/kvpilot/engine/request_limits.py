"""Admission limits: a request that could never run is rejected when it is added, not failed later."""

from __future__ import annotations

from kvpilot.engine.config import CacheConfig, SchedulerConfig
from kvpilot.engine.request import Request


def check_request_fits(request: Request, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
    """Raise ValueError, naming the numbers, if prompt + max_tokens exceeds max_model_len or the blocks it
    would hold at once exceed the whole cache (so a request admitted alone always runs to the end)."""
    num_prompt, max_tokens = request.num_prompt_tokens, request.max_tokens
    max_model_len = scheduler_config.max_model_len
    if num_prompt + max_tokens > max_model_len:
        raise ValueError(
            f"request {request.request_id!r}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
            f"{num_prompt + max_tokens} exceeds max_model_len ({max_model_len}): shorten the prompt or "
            f"lower max_tokens"
        )
    # The last sampled token is never computed, so the KV holds at most prompt + max_tokens - 1 tokens; with a
    # sliding window only those of the window and of one chunk (at most the step's token budget) at once.
    num_blocks = cache_config.max_blocks_per_request(num_prompt + max_tokens - 1,
                                                     scheduler_config.max_num_batched_tokens)
    if num_blocks > cache_config.num_blocks:
        raise ValueError(
            f"request {request.request_id!r}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs "
            f"{num_blocks} KV blocks but the whole cache has {cache_config.num_blocks}: lower max_tokens or "
            f"give the cache more memory"
        )
