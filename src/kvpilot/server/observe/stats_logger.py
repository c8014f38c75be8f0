"""The periodic status line while busy (like vLLM's): throughput, running/waiting, KV usage, prefix hits.

Throughput is the growth of the token counters over the interval. They move per engine step (see
metrics.py), so a line written while a long request decodes shows its generation rate, and the line after it
finishes no burst.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from kvpilot.engine.scheduler_stats import SchedulerStats

logger = logging.getLogger("kvpilot.server")


@dataclass(frozen=True)
class TokenTotals:
    """Cumulative prompt / generation tokens, read from the metrics counters (vllm:prompt_tokens_total,
    vllm:generation_tokens_total)."""

    num_prompt_tokens: float
    num_generation_tokens: float


def status_line(stats: SchedulerStats, before: TokenTotals, now: TokenTotals, elapsed_s: float) -> str:
    """vLLM's "Avg prompt throughput: ... tokens/s, Avg generation throughput: ..." line for one interval."""
    prompt_tps = (now.num_prompt_tokens - before.num_prompt_tokens) / elapsed_s
    gen_tps = (now.num_generation_tokens - before.num_generation_tokens) / elapsed_s
    return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} "
            f"tokens/s, Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, Prefix cache hit rate: "
            f"{stats.prefix_cache_hit_rate * 100:.1f}%{_external(stats)}")


def _external(stats: SchedulerStats) -> str:
    """vLLM's ", External prefix cache hit rate: x%" with KV offload: prompt tokens copied back from a tier."""
    if not stats.num_offload_blocks:
        return ""
    queries = stats.offload_prefix_cache_queries
    rate = stats.offload_prefix_cache_hits / queries if queries else 0.0
    return f", External prefix cache hit rate: {rate * 100:.1f}%"


async def log_stats_forever(read_stats, read_totals, interval_s: float) -> None:
    """Logs a line every interval while there is work or tokens moved since the last line; cancel to stop."""
    before, last = read_totals(), time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        stats, now, t = read_stats(), read_totals(), time.monotonic()
        busy = stats is not None and (stats.num_running or stats.num_waiting)
        if stats is not None and (busy or now != before):
            logger.info(status_line(stats, before, now, max(t - last, 1e-9)))
        before, last = now, t
