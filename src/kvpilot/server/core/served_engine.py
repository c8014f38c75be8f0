"""ServedEngine: an LLMEngine plus its EngineInfo, built inside the engine core (process or thread).

With fit_names.py, the server modules that import torch and kvpilot.model: the HTTP side never imports them
(tests/test_readme.py::test_the_http_process_never_maps_torch_while_the_core_does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.engine import LLMEngine
from kvpilot.engine.kv_events_config import KVEventsConfig
from kvpilot.engine.kv_groups import KVGroupPlan
from kvpilot.engine.kv_transfer import KVTransferConfig
from kvpilot.launch.args import EngineArgs
from kvpilot.launch.build import BuiltEngine, build_engine
from kvpilot.model.kv_dtype import kv_dtype_name
from kvpilot.model.loader import LoadedModel
from kvpilot.sampling_params import SamplingParams
from kvpilot.structured_outputs import StructuredOutputsParams
from kvpilot.server.core.engine_info import EngineInfo, KVCacheInfo
from kvpilot.server.core.fit_names import fit_device_name, fit_model_name


@dataclass(frozen=True)
class ServedEngine:
    """The engine, its start-up facts, and where its KV-cache events go (None: nowhere)."""

    engine: LLMEngine
    info: EngineInfo
    kv_events: KVEventsConfig | None = None
    kv_transfer: KVTransferConfig | None = None  # disaggregation: the engine core starts a KV connector


def _kv_groups(groups: KVGroupPlan | None) -> dict[str, Any]:
    """KVCacheInfo's KV-group fields: the groups' windows when any layer slides, the cache layers a block
    spans when the layers form several groups."""
    if groups is None or groups.group_windows == (None,):
        return {}
    return {"num_cache_layers": groups.num_slots if groups.is_hybrid else 0, "kv_group_windows": groups.group_windows}


def describe(built: BuiltEngine) -> EngineInfo:
    """Everything the HTTP side needs to know, from what build_engine computed once (KV dtype, bytes per
    block, budget, blocks)."""
    engine, config, plan = built.engine, built.loaded.config, built.kv
    limits, cache = engine.scheduler_config, engine.cache_config
    kv = KVCacheInfo(dtype=kv_dtype_name(plan.dtype), dtype_bytes=plan.dtype_bytes, block_size=cache.block_size,
                     num_blocks=cache.num_blocks, bytes_per_block=plan.capacity.bytes_per_block,
                     budget_bytes=plan.budget_bytes, num_hidden_layers=config.num_hidden_layers,
                     num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                     num_offload_blocks=cache.num_offload_blocks if cache.offload_enabled else 0,
                     num_disk_offload_blocks=cache.num_disk_offload_blocks if cache.offload_enabled else 0,
                     **_kv_groups(plan.groups))
    return EngineInfo(model=built.loaded.name, max_model_len=limits.max_model_len,
                      max_num_batched_tokens=limits.max_num_batched_tokens,
                      vocab_size=engine.vocab_size, kv=kv, max_num_seqs=limits.max_num_seqs,
                      enable_prefix_caching=cache.enable_prefix_caching, dtype=kv_dtype_name(built.loaded.dtype),
                      fit_model=fit_model_name(built.loaded), fit_device=fit_device_name(built.loaded.device),
                      prompt_gemm_dtype=_prompt_gemm_name(built.loaded),
                      quantization=built.loaded.quantization, weight_bits=built.loaded.weight_bits)


def _prompt_gemm_name(loaded: LoadedModel) -> str:
    """What CPU prompt GEMMs run in: int8 where the packed layers' Int8Gate stays open for prompts
    (--prompt-gemm-dtype int8), else the resolved dtype ("" on a GPU)."""
    if getattr(getattr(loaded.model, "int8_gate", None), "prompts", False):
        return "int8"
    return kv_dtype_name(loaded.prompt_gemm_dtype) if loaded.prompt_gemm_dtype else ""


def warm_up(engine: LLMEngine) -> None:
    """Tiny requests before serving: the first forward pass on CPU pays seconds of one-time set-up that
    would otherwise land on the first client's TTFT, and the first structured-outputs request ~0.3 s of
    llguidance's tokenizer view, built inside a step that every running stream waits for. Leaves no cached
    block behind (under one block)."""
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                       request_id="kvpilot-warmup")
    if engine.tokenizer is not None:  # a grammar needs the model's tokenizer
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, structured_outputs=
                                                     StructuredOutputsParams(choice=["ok"])),
                           request_id="kvpilot-warmup-grammar")
    while engine.has_unfinished_requests():
        engine.step()


def build_served_engine(args: EngineArgs, loaded: LoadedModel | None = None, warmup: bool = True) -> ServedEngine:
    """Loads the model (or reuses `loaded`'s weights), builds the engine and (optionally) warms it up."""
    built = build_engine(args, loaded)
    if warmup:
        warm_up(built.engine)
    transfer = args.kv_transfer()
    info = describe(built)
    if transfer is not None:
        info = dataclasses.replace(info, kv_role=transfer.role)
    return ServedEngine(built.engine, info, args.kv_events_config, transfer)
