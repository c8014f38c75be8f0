"""ServedEngine: an LLMEngine plus the facts the HTTP side may read without touching it (built off-loop)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvpilot.engine.engine import LLMEngine
from kvpilot.engine_args import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs, build_engine
from kvpilot.fit.kv_cache import kv_cache_bytes_per_block
from kvpilot.memory_size import parse_memory_size
from kvpilot.model.kv_dtype import kv_dtype_name, resolve_kv_cache_dtype
from kvpilot.model.loader import LoadedModel
from kvpilot.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    """Fixed at start-up. `capacity` is the GET /v1/kvpilot/capacity JSON (see fit/server_capacity.py)."""

    model: str
    max_model_len: int
    max_num_batched_tokens: int
    vocab_size: int
    capacity: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServedEngine:
    engine: LLMEngine
    info: EngineInfo


def _kv_budget(args: EngineArgs, loaded: LoadedModel, allocated: int) -> int:
    if args.kv_cache_memory is not None:
        return parse_memory_size(args.kv_cache_memory, "kv_cache_memory")
    if loaded.device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    return allocated  # from --gpu-memory-utilization: the profiled budget is not kept, report what was allocated


def describe(engine: LLMEngine, loaded: LoadedModel, args: EngineArgs) -> EngineInfo:
    scheduler = engine.scheduler
    config, cache = loaded.config, scheduler.cache_config
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, loaded.dtype)
    kv_dtype_bytes = torch.tensor([], dtype=kv_dtype).element_size()
    bytes_per_block = kv_cache_bytes_per_block(config, cache.block_size, kv_dtype_bytes)
    capacity = {"model": loaded.name, "num_hidden_layers": config.num_hidden_layers,
                "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                "kv_dtype_bytes": kv_dtype_bytes, "kv_cache_dtype": kv_dtype_name(kv_dtype),
                "kv_cache_memory_bytes": _kv_budget(args, loaded, cache.num_blocks * bytes_per_block),
                "block_size": cache.block_size, "num_blocks": cache.num_blocks, "bytes_per_block": bytes_per_block,
                "max_model_len": scheduler.config.max_model_len}
    return EngineInfo(model=loaded.name, max_model_len=scheduler.config.max_model_len,
                      max_num_batched_tokens=scheduler.config.max_num_batched_tokens,
                      vocab_size=engine.vocab_size, capacity=capacity)


def warm_up(engine: LLMEngine) -> None:
    """One tiny request before serving: the first forward pass on CPU pays seconds of one-time set-up that
    would otherwise land on the first client's TTFT. Leaves no cached block behind (under one block)."""
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                       request_id="kvpilot-warmup")
    while engine.has_unfinished_requests():
        engine.step()


def engine_factory(args: EngineArgs, loaded: LoadedModel | None = None,
                   warmup: bool = True) -> Callable[[], ServedEngine]:
    """A factory for EngineClient: loads the model (or reuses `loaded`'s weights), builds the engine and
    warms it up."""

    def build() -> ServedEngine:
        engine, model = build_engine(args, loaded)
        if warmup:
            warm_up(engine)
        return ServedEngine(engine, describe(engine, model, args))

    return build
