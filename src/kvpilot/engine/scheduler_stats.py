"""A snapshot of scheduler and KV cache state for metrics (vllm:num_requests_running, kv_cache_usage_perc...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpilot.engine.kv_manager import KVCacheManager


@dataclass(frozen=True)
class SchedulerStats:
    """Gauges (now) and cumulative counters (since start) of one scheduler.

    Invariants: num_free_blocks + num_cached_blocks + num_used_blocks == num_total_blocks;
    0 <= kv_cache_usage <= 1; prefix_cache_hits <= prefix_cache_queries (both in tokens, like vLLM).

    KV offload (engine/kv_offload.py; all 0 without it): offload_prefix_cache_queries / _hits count, in tokens,
    the prefix hits copied back from an offload tier (vLLM's external_prefix_cache_queries / _hits; the pool's
    own hits stay in prefix_cache_hits); the tiers' sizes and fill in blocks; cumulative block copies: saved to
    the host tier, loaded back from it, demoted to the disk tier, loaded back from disk, and saves dropped.
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
    offload_prefix_cache_queries: int = 0
    offload_prefix_cache_hits: int = 0
    num_offload_blocks: int = 0
    num_offload_used_blocks: int = 0
    num_disk_offload_blocks: int = 0
    num_disk_offload_used_blocks: int = 0
    num_offload_saved_blocks: int = 0
    num_offload_loaded_blocks: int = 0
    num_offload_demoted_blocks: int = 0
    num_offload_disk_loaded_blocks: int = 0
    num_offload_dropped_blocks: int = 0
    num_offload_overlapped_blocks: int = 0  # of the loaded blocks, those copied beside another step (prefetch)
    # disaggregation (engine/kv_transfer.py; the engine core's connector fills them): on or off, blocks held for
    # decode workers, and cumulative transfers, bytes and failures each way (send: prefill side, pull: decode
    # side), and held requests freed by the timeout
    kv_transfer: bool = False
    num_kv_held_blocks: int = 0
    num_kv_transfers_sent: int = 0
    num_kv_transfer_sent_bytes: int = 0
    num_kv_transfer_send_failures: int = 0
    num_kv_transfers_pulled: int = 0
    num_kv_transfer_pulled_bytes: int = 0
    num_kv_transfer_pull_failures: int = 0
    num_kv_transfer_timeouts: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def offload_stats(kv: KVCacheManager) -> dict[str, Any]:
    """The offload fields of SchedulerStats for a KV manager with offload tiers."""
    tiers = kv.offload
    assert tiers is not None
    traffic, disk = tiers.stats, tiers.disk
    return dict(offload_prefix_cache_queries=kv.offload_prefix_stats.num_queries,
                offload_prefix_cache_hits=kv.offload_prefix_stats.num_hits,
                num_offload_blocks=tiers.host.num_slots, num_offload_used_blocks=len(tiers.host),
                num_disk_offload_blocks=disk.num_slots if disk is not None else 0,
                num_disk_offload_used_blocks=len(disk) if disk is not None else 0,
                num_offload_saved_blocks=traffic.num_saved, num_offload_loaded_blocks=traffic.num_loaded,
                num_offload_demoted_blocks=traffic.num_demoted,
                num_offload_disk_loaded_blocks=traffic.num_disk_loaded,
                num_offload_dropped_blocks=traffic.num_dropped,
                num_offload_overlapped_blocks=traffic.num_loaded_beside)
