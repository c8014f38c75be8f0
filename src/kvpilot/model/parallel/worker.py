"""A tensor-parallel rank other than 0: its own process, its own shard of the model and of the KV cache,
driven by rank 0 through a pipe of small named messages ("step" with the scheduler's diff, "shutdown").

It runs every step rank 0 runs (the all-reduces inside the layers pair them up) and commits the sampled ids
rank 0 broadcasts, so its persistent batch always equals rank 0's.
"""

from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.model.kv_dtype import resolve_kv_cache_dtype
from kvpilot.model.parallel.group import TPGroup
from kvpilot.model.parallel.shard import parallelize
from kvpilot.model.runner import ModelRunner, RunnerLimits


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build the same engine shard as rank 0 (picklable)."""

    rank: int
    world_size: int
    init_method: str
    load_kwargs: dict[str, Any]  # kvpilot.model.loader.load_model's arguments but tp_rank, as rank 0 used them
    kv_cache_dtype: str
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    attention_backend: str
    eos_token_ids: tuple[int, ...] = ()
    num_threads: int = 1


def build_rank(loaded, group: TPGroup, spec: WorkerSpec) -> ModelRunner:
    """The rank's runner over `loaded`, which holds this rank's shard (load_model's tp_rank / tp_size)."""
    if loaded.shard is None or (loaded.shard.rank, loaded.shard.world_size) != (group.rank, group.world_size):
        raise RuntimeError(f"rank {group.rank} of {group.world_size} was handed a model loaded for "
                           f"{'no rank' if loaded.shard is None else f'rank {loaded.shard.rank}'}")
    parallelize(loaded.model, group)
    shard = dataclasses.replace(loaded, config=loaded.shard.local_config)
    kv_dtype = resolve_kv_cache_dtype(spec.kv_cache_dtype, loaded.dtype)
    return ModelRunner(shard, spec.num_blocks, spec.block_size, kv_dtype,
                       limits=RunnerLimits(spec.max_num_seqs, spec.max_model_len),
                       attention_backend=spec.attention_backend, eos_token_ids=spec.eos_token_ids, tp=group)


def worker_main(conn, spec: WorkerSpec) -> None:
    """The rank's process: join the group, load its shard, then run steps until told to stop."""
    from kvpilot.model.loader import load_model

    group = None
    try:
        conn.send(("alive", None))  # rank 0 joins the group only once every worker got this far
        torch.set_num_threads(spec.num_threads)
        group = TPGroup.join(spec.rank, spec.world_size, spec.init_method)
        runner = build_rank(load_model(**spec.load_kwargs, tp_rank=spec.rank), group, spec)
        conn.send(("ready", None))
        while True:
            kind, payload = conn.recv()
            if kind == "shutdown":
                break
            runner.execute_model(payload).result()
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
