"""kvpilot.engine: the torch-free core (request state, block pool, KV manager, scheduler) and the engine loop."""

from kvpilot.engine.block_pool import BlockCounts, BlockPool, KVCacheIntegrityError, chained_block_hash
from kvpilot.engine.config import CacheConfig, EngineConfigError, SchedulerConfig, check_model_len_fits
from kvpilot.engine.kv_manager import KVCacheManager, PrefixHit
from kvpilot.engine.request import FinishReason, Request, RequestStatus
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_integrity import SchedulerIntegrityError
from kvpilot.engine.scheduler_output import (NewRequestData, RequestUpdate, RunnerOutput, RunningRequestData,
                                             SampledToken, ScheduledChunk, SchedulerOutput)
from kvpilot.engine.scheduler_stats import SchedulerStats
from kvpilot.engine.timeline import RequestMetrics, Timeline

__all__ = [
    "BlockCounts",
    "BlockPool",
    "CacheConfig",
    "EngineConfigError",
    "FinishReason",
    "KVCacheIntegrityError",
    "KVCacheManager",
    "NewRequestData",
    "PrefixHit",
    "Request",
    "RequestMetrics",
    "RequestStatus",
    "RequestUpdate",
    "RunnerOutput",
    "RunningRequestData",
    "SampledToken",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerIntegrityError",
    "SchedulerOutput",
    "SchedulerStats",
    "Timeline",
    "chained_block_hash",
    "check_model_len_fits",
]
