"""A snapshot of scheduler and KV cache state for metrics (vllm:num_requests_running, kv_cache_usage_perc...)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    """Gauges (now) and cumulative counters (since start) of one scheduler.

    Invariants: num_free_blocks + num_cached_blocks + num_used_blocks == num_total_blocks;
    0 <= kv_cache_usage <= 1; prefix_cache_hits <= prefix_cache_queries (both in tokens, like vLLM).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    num_total_blocks: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
