"""ServedEngine: an LLMEngine plus its EngineInfo, built inside the engine core (process or thread).

This is the only server module that imports torch and kvpilot.model: the HTTP side never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.engine.engine import LLMEngine
from kvpilot.engine_args import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs, build_engine
from kvpilot.fit.kv_cache import kv_cache_bytes_per_block
from kvpilot.memory_size import parse_memory_size
from kvpilot.model.kv_dtype import kv_dtype_name, resolve_kv_cache_dtype
from kvpilot.model.loader import LoadedModel
from kvpilot.sampling_params import SamplingParams
from kvpilot.server.engine_info import EngineInfo, KVCacheInfo


@dataclass(frozen=True)
class ServedEngine:
    engine: LLMEngine
    info: EngineInfo


def _kv_budget(args: EngineArgs, loaded: LoadedModel, allocated: int) -> int:
    if args.kv_cache_memory is not None:
        return parse_memory_size(args.kv_cache_memory, "kv_cache_memory")
    if loaded.device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    return allocated  # from --gpu-memory-utilization: build_engine does not return its profiled budget


def describe(engine: LLMEngine, loaded: LoadedModel, args: EngineArgs) -> EngineInfo:
    """Everything the HTTP side needs to know, computed once (KV dtype, bytes per block, budget)."""
    scheduler = engine.scheduler
    config, cache = loaded.config, scheduler.cache_config
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, loaded.dtype)
    dtype_bytes = torch.tensor([], dtype=kv_dtype).element_size()
    bytes_per_block = kv_cache_bytes_per_block(config, cache.block_size, dtype_bytes)
    kv = KVCacheInfo(dtype=kv_dtype_name(kv_dtype), dtype_bytes=dtype_bytes, block_size=cache.block_size,
                     num_blocks=cache.num_blocks, bytes_per_block=bytes_per_block,
                     budget_bytes=_kv_budget(args, loaded, cache.num_blocks * bytes_per_block),
                     num_hidden_layers=config.num_hidden_layers, num_key_value_heads=config.num_key_value_heads,
                     head_dim=config.head_dim)
    return EngineInfo(model=loaded.name, max_model_len=scheduler.config.max_model_len,
                      max_num_batched_tokens=scheduler.config.max_num_batched_tokens,
                      vocab_size=engine.vocab_size, kv=kv)


def warm_up(engine: LLMEngine) -> None:
    """One tiny request before serving: the first forward pass on CPU pays seconds of one-time set-up that
    would otherwise land on the first client's TTFT. Leaves no cached block behind (under one block)."""
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                       request_id="kvpilot-warmup")
    while engine.has_unfinished_requests():
        engine.step()


def build_served_engine(args: EngineArgs, loaded: LoadedModel | None = None, warmup: bool = True) -> ServedEngine:
    """Loads the model (or reuses `loaded`'s weights), builds the engine and (optionally) warms it up."""
    engine, model = build_engine(args, loaded)
    if warmup:
        warm_up(engine)
    return ServedEngine(engine, describe(engine, model, args))
