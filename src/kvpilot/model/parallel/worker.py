"""A tensor-parallel rank other than 0: its own process, its own shard of the model and of the KV cache (on its
own GPU under CUDA), driven by rank 0 through a pipe of small named messages:

    rank 0 -> worker: ("kv_budget", KVBudgetRequest)  -> ("kv_budget", bytes)   profile with every rank at once
                      ("build", RunnerSpec)           -> ("ready", None)        the runner over the sized cache
                      ("step", SchedulerOutput)                                 one step, no answer
                      ("shutdown", None)
    worker -> rank 0: ("alive", None) on start, ("loaded", None) once its shard is in memory,
                      ("error", traceback) when anything fails (then it exits)

It runs every step rank 0 runs (the all-reduces inside the layers pair them up) and commits the sampled ids
rank 0 broadcasts, so its persistent batch always equals rank 0's.
"""

from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.engine.kv_groups import KVGroupPlan
from kvpilot.model.kv_offload import OffloadSpec
from kvpilot.model.parallel.group import TPGroup, rank_device
from kvpilot.model.parallel.shard import parallelize
from kvpilot.model.runner import ModelRunner, RunnerLimits


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to join the group and load its shard (picklable)."""

    rank: int
    world_size: int
    init_method: str
    load_kwargs: dict[str, Any]  # kvpilot.model.loader.load_model's arguments but tp_rank and device
    device: str | None = None  # as the user gave it: rank_device places each rank
    num_threads: int = 1


@dataclass(frozen=True)
class RunnerSpec:
    """The runner every rank builds once rank 0 has sized the KV cache (picklable)."""

    kv_dtype: torch.dtype
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    attention_backend: str
    eos_token_ids: tuple[int, ...] = ()
    offload: OffloadSpec | None = None  # KV offload tiers (model/kv_offload.py): each rank holds its share
    kv_groups: KVGroupPlan | None = None  # how layers share the cache (engine/kv_groups.py); None: one group
    calibrate_kv_scales: bool = True  # fp8 KV: scales from the first step (False: fixed at 1; model/kv_scales.py)


@dataclass(frozen=True)
class KVBudgetRequest:
    """kvpilot.model.kv_budget.cuda_kv_budget's arguments: every rank profiles its own GPU at once."""

    utilization: float
    num_tokens: int
    block_size: int
    kv_dtype: torch.dtype


def load_rank(spec: WorkerSpec):
    """Joins the group and loads this rank's shard on its device, row-parallel (so a profiling forward
    all-reduces as the steps will); returns (group, loaded)."""
    from kvpilot.model.loader import load_model

    device = rank_device(spec.device, spec.rank, spec.world_size)
    group = TPGroup.join(spec.rank, spec.world_size, spec.init_method, device)
    try:
        loaded = load_model(**spec.load_kwargs, device=device, tp_rank=spec.rank)
    except BaseException:
        group.leave()  # the process-wide default group: a later engine in this process makes its own
        raise
    parallelize(loaded.model, group)
    return group, loaded


def build_rank(loaded, group: TPGroup, spec: RunnerSpec) -> ModelRunner:
    """The rank's runner over `loaded`, which holds this rank's shard (load_model's tp_rank / tp_size)."""
    if loaded.shard is None or (loaded.shard.rank, loaded.shard.world_size) != (group.rank, group.world_size):
        raise RuntimeError(f"rank {group.rank} of {group.world_size} was handed a model loaded for "
                           f"{'no rank' if loaded.shard is None else f'rank {loaded.shard.rank}'}")
    parallelize(loaded.model, group)
    return make_runner(dataclasses.replace(loaded, config=loaded.shard.local_config), spec, group)


def make_runner(loaded, spec: RunnerSpec, tp: TPGroup | None = None) -> ModelRunner:
    return ModelRunner(loaded, spec.num_blocks, spec.block_size, spec.kv_dtype,
                       limits=RunnerLimits(spec.max_num_seqs, spec.max_model_len),
                       attention_backend=spec.attention_backend, eos_token_ids=spec.eos_token_ids, tp=tp,
                       offload=spec.offload, kv_groups=spec.kv_groups, calibrate_kv_scales=spec.calibrate_kv_scales)


def rank_kv_budget(loaded, request: KVBudgetRequest) -> int:
    from kvpilot.model.kv_budget import cuda_kv_budget

    return cuda_kv_budget(loaded, request.utilization, request.num_tokens, request.block_size, request.kv_dtype)


def worker_main(conn, spec: WorkerSpec) -> None:
    """The rank's process: join the group, load its shard, then answer rank 0's messages until told to stop."""
    group = None
    try:
        conn.send(("alive", None))  # rank 0 joins the group only once every worker got this far
        torch.set_num_threads(spec.num_threads)
        group, loaded = load_rank(spec)
        conn.send(("loaded", None))
        runner = None
        while True:
            kind, payload = conn.recv()
            if kind == "shutdown":
                break
            if kind == "step":
                runner.execute_model(payload).result()
            elif kind == "kv_budget":
                conn.send(("kv_budget", rank_kv_budget(loaded, payload)))
            elif kind == "build":
                runner = build_rank(loaded, group, payload)
                conn.send(("ready", None))
    except (EOFError, KeyboardInterrupt):  # rank 0 is gone
        pass
    except Exception:  # noqa: BLE001 - reported to rank 0, which fails the engine with it
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if group is not None:
            group.leave()
