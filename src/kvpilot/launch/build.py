"""build_engine: loads the model (or reuses loaded weights), sizes the KV cache once (KVCachePlan: dtype, bytes
per block, budget, blocks), and wires scheduler + runner into an LLMEngine. Imports torch: only the engine
core (or the offline `LLM`) calls it, never the HTTP process.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from kvpilot.engine.config import (CacheConfig, EngineConfigError, SchedulerConfig, check_model_len_fits,
                                   largest_model_len)
from kvpilot.engine.engine import LLMEngine
from kvpilot.engine.kv_groups import KVGroupPlan
from kvpilot.engine.ngram_proposer import NgramProposer
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.spec_config import SpeculativeConfig
from kvpilot.engine.speculator import DraftProposer, Speculator
from kvpilot.launch.args import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs
from kvpilot.launch.draft_model import build_draft_proposer, draft_kv_share, load_draft
from kvpilot.launch.eagle import build_eagle_proposer, load_eagle
from kvpilot.launch.graphs import GraphPlan, capture_graphs, graph_plan
from kvpilot.launch.offload_plan import OffloadPlan, plan_offload
from kvpilot.launch.tp import TPLaunch, rank_config
from kvpilot.fit.kv_cache import KvCapacity, format_capacity_line, format_token_slots, kv_capacity_for_memory
from kvpilot.memory_size import format_bytes, parse_memory_size
from kvpilot.model.kv_dtype import kv_dtype_name, resolve_kv_cache_dtype
from kvpilot.model.layers.rope import RotaryEmbedding
from kvpilot.model.hub import resolve_model
from kvpilot.model.config import ModelConfig
from kvpilot.model.loader import LoadedModel, load_model
from kvpilot.model.onednn_caches import bound_onednn_caches
from kvpilot.model.parallel.worker import KVBudgetRequest, RunnerSpec, make_runner, rank_kv_budget
from kvpilot.model.step_budget import default_max_num_batched_tokens

logger = logging.getLogger("kvpilot")


@dataclass(frozen=True)
class KVCachePlan:
    """The KV cache as built, computed once: `budget_bytes` is what it was sized from (kv_cache_memory, the
    CPU default, or on CUDA the profiled share of gpu_memory_utilization); `capacity` the blocks that fit."""

    dtype: torch.dtype
    dtype_bytes: int
    budget_bytes: int
    capacity: KvCapacity
    offload: OffloadPlan | None = None  # KV offload tiers (--kv-offloading-size, --kv-offload-dir)
    groups: KVGroupPlan | None = None  # how the layers share the blocks (engine/kv_groups.py); None: one group


@dataclass(frozen=True)
class BuiltEngine:
    engine: LLMEngine
    loaded: LoadedModel
    kv: KVCachePlan


def kv_cache_budget_bytes(args: EngineArgs, loaded: LoadedModel, max_num_batched_tokens: int,
                          kv_dtype: torch.dtype, tp: TPLaunch | None = None, graphs: GraphPlan = GraphPlan()) -> int:
    """Bytes for the KV cache: kv_cache_memory if given; on CUDA from gpu_memory_utilization (with tensor
    parallelism: the smallest of the ranks' GPUs) less what `graphs` will take; else the CPU default."""
    if args.kv_cache_memory is not None:
        return parse_memory_size(args.kv_cache_memory, "kv_cache_memory")
    if loaded.device.type == "cuda":
        set_aside = graphs.set_aside_bytes(loaded.config, loaded.dtype.itemsize)
        request = KVBudgetRequest(args.gpu_memory_utilization, max_num_batched_tokens, args.block_size, kv_dtype)
        return (tp.kv_budget(request) if tp is not None else rank_kv_budget(loaded, request)) - set_aside
    return DEFAULT_CPU_KV_CACHE_BYTES


def build_engine(args: EngineArgs, loaded: LoadedModel | None = None) -> BuiltEngine:
    """Loads the model (or reuses `loaded`: its weights are read-only, so engines may share them) and builds
    the engine; EngineConfigError / ModelLoadError say what to change. With tensor_parallel_size > 1 every
    rank loads its shard (engine_tp.TPLaunch); a failure before the engine exists stops the ranks again."""
    args.check()
    bound_onednn_caches()  # before the first GEMM: the engine's memory stays flat over hours of mixed steps
    hub_id = args.model
    if loaded is None:  # a hub id is downloaded once, here, before any TP rank starts to read it
        args = dataclasses.replace(args, model=local_model(args), revision=None, gguf_file=None)
    tp = TPLaunch.start(args, loaded) if args.tensor_parallel_size > 1 else None
    try:
        built = _build(args, tp.loaded if tp is not None else loaded or load_model(
            args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
            max_model_len=args.max_model_len, seed=args.seed, quantization=args.quantization,
            prompt_gemm_dtype=args.prompt_gemm_dtype), tp)
    except BaseException:
        if tp is not None:
            tp.abort()
        raise
    if hub_id != args.model and loaded is None:
        built.loaded.name = str(hub_id)  # served as the id the user gave, not the cache folder's commit
    return built


def local_model(args: EngineArgs) -> str | None:
    """args.model, or for a Hugging Face Hub id the local path of its downloaded files."""
    if args.load_format == "dummy" or (args.model or "").startswith("dummy:"):
        return args.model
    return resolve_model(args.model, revision=args.revision, download_dir=args.download_dir,
                         gguf_file=args.gguf_file)


def _build(args: EngineArgs, loaded: LoadedModel, tp: TPLaunch | None) -> BuiltEngine:
    max_num_batched_tokens = args.max_num_batched_tokens or default_max_num_batched_tokens(
        loaded.device, args.max_num_seqs, args.usage_context)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, loaded.dtype)
    speculative = args.speculative
    # loaded before the budget is measured: on CUDA its weights come out of it (launch/draft_model.py)
    method = speculative.method if speculative is not None else None
    draft = load_draft(args, speculative, loaded) if method == "draft_model" else \
        load_eagle(args, speculative, loaded) if method in ("eagle", "eagle3") else None  # launch/eagle.py
    groups = kv_group_plan(loaded.config, args)
    graphs = graph_plan(args, loaded, kv_dtype, max_num_batched_tokens, hybrid=groups.is_hybrid)
    budget = kv_cache_budget_bytes(args, loaded, max_num_batched_tokens, kv_dtype, tp, graphs)
    if draft is not None:  # the draft's cache: its share of the budget, as many blocks as the target's
        budget -= int(budget * draft_kv_share(loaded, draft, args.block_size, args.kv_cache_dtype))
    element_size = torch.tensor([], dtype=kv_dtype).element_size()
    config = loaded.config
    window, extra_windows = groups.group_windows[0], groups.group_windows[1:]
    # The same function `kvpilot fit` predicts with: plan and engine agree by construction.
    capacity = kv_capacity_for_memory(rank_config(loaded), budget, args.block_size, element_size,
                                      args.max_model_len or config.max_position_embeddings, window,
                                      extra_windows, groups.num_slots)
    if capacity.num_blocks < 1:
        raise EngineConfigError(f"the KV cache budget of {format_bytes(budget)} holds no block of "
                                f"{format_bytes(capacity.bytes_per_block)}: raise kv_cache_memory")
    events = args.kv_events_config
    offload = plan_offload(args, capacity.bytes_per_block, groups.group_windows,
                           pinned=loaded.device.type == "cuda")
    cache_config = CacheConfig(num_blocks=capacity.num_blocks, block_size=args.block_size,
                               enable_prefix_caching=args.enable_prefix_caching,
                               enable_kv_cache_events=events is not None and events.publishes,
                               sliding_window=window, extra_group_windows=extra_windows,
                               num_offload_blocks=offload.num_host_blocks if offload else 0,
                               num_disk_offload_blocks=offload.num_disk_blocks if offload else 0,
                               overlap_offload_loads=args.kv_offload_overlap,
                               pace_offload_loads=loaded.device.type == "cpu")
    max_model_len = default_max_model_len(args.max_model_len, config.max_position_embeddings, capacity,
                                          cache_config, max_num_batched_tokens)
    capacity = dataclasses.replace(capacity, max_model_len=max_model_len)
    _check_positions(loaded, max_model_len)
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy)
    check_model_len_fits(scheduler_config, cache_config)
    logger.info("%s; KV stored as %s", format_capacity_line(capacity), kv_dtype_name(kv_dtype))
    eos_token_ids = eos_token_ids_of(loaded)
    # fp8 KV scales from the first step, unless turned off or K/V cross processes (disaggregation: both sides
    # must read them with one scale, 1)
    spec = RunnerSpec(kv_dtype, capacity.num_blocks, args.block_size, args.max_num_seqs, max_model_len,
                      args.attention_backend, tuple(eos_token_ids), offload.spec if offload else None, groups,
                      calibrate_kv_scales=args.calculate_kv_scales and args.kv_role is None)
    runner = tp.executor(spec) if tp is not None else make_runner(loaded, spec)
    capture_graphs(runner, graphs, max_num_batched_tokens)
    build_proposer = build_eagle_proposer if method in ("eagle", "eagle3") else build_draft_proposer
    proposer = build_proposer(draft, args, capacity.num_blocks, max_model_len, max_num_batched_tokens) \
        if draft is not None else None
    if proposer is not None:  # its drafts are computed when the target's step runs (model/draft_proposer.py)
        runner.drafter = proposer
    scheduler = Scheduler(scheduler_config, cache_config, eos_token_ids,
                          speculator=make_speculator(speculative, proposer))
    # speculation verifies a step's drafts before the next step is scheduled (EngineArgs refuses async with it)
    async_scheduling = args.async_scheduling if args.async_scheduling is not None else \
        loaded.device.type == "cuda" and speculative is None
    engine = LLMEngine(scheduler, runner, loaded.tokenizer, loaded.config.vocab_size,
                       async_scheduling=async_scheduling)
    return BuiltEngine(engine, loaded, KVCachePlan(kv_dtype, element_size, budget, capacity, offload, groups))


def kv_group_plan(config: ModelConfig, args: EngineArgs) -> KVGroupPlan:
    """How the model's layers share the KV pool (engine/kv_groups.py): an interleaved model gets several groups,
    so its sliding layers' blocks are freed once out of their window, unless disable_hybrid_kv_cache_manager
    or disaggregation moves the KV (its transfers carry one block table: then one group, with an INFO line)."""
    plan = config.kv_group_plan(hybrid=not args.disable_hybrid_kv_cache_manager)
    if plan.is_hybrid and args.kv_role is not None:
        logger.info("KV groups off with kv_role %s: disaggregation moves one block table per request, so the "
                    "sliding layers' blocks are kept for the whole context", args.kv_role)
        return config.kv_group_plan(hybrid=False)
    return plan


def make_speculator(config: SpeculativeConfig | None, proposer: DraftProposer | None = None) -> Speculator | None:
    """The scheduler's speculator for speculative_config (None: off); `proposer`: the draft model's
    (launch/draft_model.py), else the n-gram proposer, with an INFO line saying what runs."""
    if config is None:
        return None
    if proposer is not None:
        return Speculator(config, proposer)
    logger.info("speculative decoding: %s, up to %d drafts a step (n-grams of %d..%d tokens, longest first), "
                "as many as the cost model finds worth their rows", config.method, config.num_speculative_tokens,
                config.prompt_lookup_min, config.prompt_lookup_max)
    return Speculator(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))


def _check_positions(loaded: LoadedModel, max_model_len: int) -> None:
    """Weights reused from another engine (LLM(loaded=...)) keep the rotary tables their load sized: a longer
    max_model_len would index past them mid-request. Refused here, with what to do."""
    sizes = [m.max_positions for m in loaded.model.modules() if isinstance(m, RotaryEmbedding)]
    if sizes and min(sizes) < max_model_len:
        raise EngineConfigError(f"max_model_len {max_model_len} is longer than the {min(sizes)} positions the "
                                "loaded model's rotary tables hold (its load's max_model_len): load the model with "
                                f"max_model_len >= {max_model_len}, or ask for at most {min(sizes)}")


def default_max_model_len(requested: int | None, model_context: int, capacity: KvCapacity,
                          cache_config: CacheConfig, max_chunk_tokens: int) -> int:
    """max_model_len as given; left out, the model's context, or, when one request of it would hold more blocks
    than there are (over every KV group: a sliding window spares some), the longest that fits the whole cache,
    with an INFO line saying how to get more. vLLM fails there; a user who named no length gets a working
    engine. A requested length that does not fit is left for check_model_len_fits to refuse with the largest
    value that fits."""
    if requested is not None:
        return requested
    fits = largest_model_len(cache_config, max_chunk_tokens, model_context)
    if fits == model_context:
        return model_context
    blocks_needed = cache_config.max_blocks_per_request(model_context, max_chunk_tokens)
    mib_needed = -(-blocks_needed * capacity.bytes_per_block // 2**20)
    logger.info("max_model_len: the model's context of %s tokens does not fit the %s KV cache (%s); using "
                "max_model_len %d. For the full context: --kv-cache-memory %dMiB (or set --max-model-len)",
                f"{model_context:,}", format_bytes(capacity.num_bytes), format_token_slots(capacity), fits,
                mib_needed)
    return fits


def eos_token_ids_of(loaded: LoadedModel) -> tuple[int, ...]:
    """The one EOS set: the tokenizer's EOS ids and the config's (generation) EOS ids, deduplicated."""
    tokenizer_eos = loaded.tokenizer.eos_token_ids if loaded.tokenizer else ()
    return tuple(dict.fromkeys([*tokenizer_eos, *loaded.config.eos_token_ids]))
