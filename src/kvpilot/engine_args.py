"""EngineArgs: every engine setting, named like the server flags (and vLLM's), validated in one place.

`build_engine(args)` loads the model, sizes the KV cache, and wires scheduler + runner into an LLMEngine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvpilot.engine.config import CacheConfig, EngineConfigError, SchedulerConfig, check_model_len_fits
from kvpilot.engine.engine import LLMEngine
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.fit.kv_cache import format_capacity_line, kv_capacity_for_memory
from kvpilot.fit.memory import CPU_DEFAULT_KV_CACHE_BYTES
from kvpilot.memory_size import format_bytes, parse_memory_size
from kvpilot.model.kv_dtype import check_kv_cache_dtype, kv_dtype_name, resolve_kv_cache_dtype
from kvpilot.model.loader import LoadedModel, load_model
from kvpilot.model.attention import ATTENTION_BACKENDS
from kvpilot.model.runner import ModelRunner, RunnerLimits
from kvpilot.sampling_params import SamplingParams

logger = logging.getLogger("kvpilot")

# Like vLLM's VLLM_CPU_KVCACHE_SPACE (4 GiB there), 2 GiB here: RSS matters on small boxes. Defined in `fit`
# so the planner and the engine use one number.
DEFAULT_CPU_KV_CACHE_BYTES = CPU_DEFAULT_KV_CACHE_BYTES


@dataclass(kw_only=True)
class EngineArgs:
    """Engine settings. None means "derive a sensible value" (documented per field in the CLI help)."""

    model: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    kv_cache_memory: int | str | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    attention_backend: str = "auto"
    async_scheduling: bool | None = None  # None: on where the device computes asynchronously (CUDA)

    def check(self) -> None:
        """Validates what can be checked before loading the model; EngineConfigError names the setting."""
        if not 0 < self.gpu_memory_utilization <= 1:
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None:
            try:
                parse_memory_size(self.kv_cache_memory, "kv_cache_memory")
            except ValueError as exc:
                raise EngineConfigError(str(exc)) from exc
        try:
            check_kv_cache_dtype(self.kv_cache_dtype)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from exc
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise EngineConfigError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise EngineConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got "
                                    f"{self.attention_backend!r}")
        CacheConfig(num_blocks=1, block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching)
        SchedulerConfig(max_model_len=1, max_num_seqs=self.max_num_seqs,
                        max_num_batched_tokens=self.max_num_batched_tokens or max(2048, self.max_num_seqs),
                        scheduling_policy=self.scheduling_policy)


def _cuda_kv_budget(loaded: LoadedModel, utilization: float, num_tokens: int, block_size: int,
                    kv_dtype: torch.dtype) -> int:
    """vLLM-style: GPU memory * utilization, minus what is in use, minus a full-budget forward's activations."""
    device = loaded.device
    num_blocks = num_tokens // block_size + 1
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    profiler = ModelRunner(loaded, num_blocks, block_size, kv_dtype,
                           limits=RunnerLimits(max_num_seqs=1, max_model_len=num_tokens))
    cache_bytes = torch.cuda.memory_allocated(device) - baseline
    new = NewRequestData("profile", [0] * num_tokens, [], SamplingParams(), list(range(num_blocks)), 0)
    profiler.forward_logits(SchedulerOutput([ScheduledChunk("profile", 0, num_tokens, True)], new_requests=[new]))
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - baseline - cache_bytes
    del profiler
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(total * utilization - (total - free) - activations)


def kv_cache_budget_bytes(args: EngineArgs, loaded: LoadedModel, max_num_batched_tokens: int,
                          kv_dtype: torch.dtype) -> int:
    """Bytes for the KV cache: kv_cache_memory if given; on CUDA from gpu_memory_utilization; else the CPU default."""
    if args.kv_cache_memory is not None:
        return parse_memory_size(args.kv_cache_memory, "kv_cache_memory")
    if loaded.device.type == "cuda":
        return _cuda_kv_budget(loaded, args.gpu_memory_utilization, max_num_batched_tokens, args.block_size,
                               kv_dtype)
    return DEFAULT_CPU_KV_CACHE_BYTES


def build_engine(args: EngineArgs, loaded: LoadedModel | None = None) -> tuple[LLMEngine, LoadedModel]:
    """Loads the model (or reuses `loaded`: its weights are read-only, so engines may share them) and builds
    the engine; EngineConfigError / ModelLoadError say what to change."""
    args.check()
    if loaded is None:
        loaded = load_model(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                            max_model_len=args.max_model_len, seed=args.seed)
    max_model_len = args.max_model_len or loaded.config.max_position_embeddings
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or max(2048, args.max_num_seqs),
        scheduling_policy=args.scheduling_policy)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, loaded.dtype)
    budget = kv_cache_budget_bytes(args, loaded, scheduler_config.max_num_batched_tokens, kv_dtype)
    element_size = torch.tensor([], dtype=kv_dtype).element_size()
    # The same function `kvpilot fit` predicts with: plan and engine agree by construction.
    capacity = kv_capacity_for_memory(loaded.config, budget, args.block_size, element_size, max_model_len)
    if capacity.num_blocks < 1:
        raise EngineConfigError(f"the KV cache budget of {format_bytes(budget)} holds no block of "
                                f"{format_bytes(capacity.bytes_per_block)}: raise kv_cache_memory")
    cache_config = CacheConfig(num_blocks=capacity.num_blocks, block_size=args.block_size,
                               enable_prefix_caching=args.enable_prefix_caching)
    check_model_len_fits(scheduler_config, cache_config)
    logger.info("%s; KV stored as %s", format_capacity_line(capacity), kv_dtype_name(kv_dtype))
    eos_token_ids = eos_token_ids_of(loaded)
    runner = ModelRunner(loaded, capacity.num_blocks, args.block_size, kv_dtype,
                         limits=RunnerLimits(args.max_num_seqs, max_model_len),
                         attention_backend=args.attention_backend, eos_token_ids=eos_token_ids)
    scheduler = Scheduler(scheduler_config, cache_config, eos_token_ids)
    async_scheduling = args.async_scheduling if args.async_scheduling is not None else loaded.device.type == "cuda"
    engine = LLMEngine(scheduler, runner, loaded.tokenizer, loaded.config.vocab_size,
                       async_scheduling=async_scheduling)
    return engine, loaded


def eos_token_ids_of(loaded: LoadedModel) -> tuple[int, ...]:
    """The one EOS set: the tokenizer's EOS ids and the config's (generation) EOS ids, deduplicated."""
    tokenizer_eos = loaded.tokenizer.eos_token_ids if loaded.tokenizer else ()
    return tuple(dict.fromkeys([*tokenizer_eos, *loaded.config.eos_token_ids]))
