"""Building the tensor-parallel side of an engine (tensor_parallel_size > 1): the load arguments every rank
repeats, the worker processes, rank 0's shard, and the executor the engine drives. CPU only for now (gloo):
on CUDA the KV-budget profile would need every rank in the forward."""

from __future__ import annotations

import os

import torch
import torch.distributed

from kvpilot.engine.config import EngineConfigError
from kvpilot.engine_args import EngineArgs
from kvpilot.model.config import ModelConfig
from kvpilot.model.loader import LoadedModel, load_model
from kvpilot.model.parallel.executor import TensorParallelExecutor, free_tcp_address
from kvpilot.model.parallel.group import TPGroup
from kvpilot.model.parallel.worker import WorkerSpec, build_rank


def tp_load_kwargs(args: EngineArgs) -> dict:
    """load_model's arguments for every rank but its tp_rank: the same weights (dummy draws are seeded),
    always dense, each rank reading only its shard."""
    return dict(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                max_model_len=args.max_model_len, seed=args.seed, quantization="none",
                tp_size=args.tensor_parallel_size)


def load_for_tp(args: EngineArgs, loaded: LoadedModel | None) -> LoadedModel:
    """Rank 0's shard; a model that does not split fails here, naming the sizes that work (ModelLoadError),
    and anything else with EngineConfigError saying what to change."""
    if torch.distributed.is_initialized():
        raise EngineConfigError("another tensor-parallel engine is running in this process: shut it down first "
                                "(engine.runner.shutdown()); torch.distributed has one default group per process")
    if loaded is not None:
        raise EngineConfigError("tensor parallelism loads its own shards on every rank: pass the model, not "
                                "an already loaded one")
    loaded = load_model(**tp_load_kwargs(args), tp_rank=0)
    if loaded.device.type != "cpu":
        raise EngineConfigError("tensor_parallel_size > 1 runs on CPU (gloo) so far; on a GPU use "
                                "--tensor-parallel-size 1")
    return loaded


def rank_config(loaded: LoadedModel) -> ModelConfig:
    """The config one rank's KV cache is sized by (its KV heads)."""
    return loaded.config if loaded.shard is None else loaded.shard.local_config


def start_tp_executor(args: EngineArgs, loaded: LoadedModel, num_blocks: int, max_model_len: int,
                      eos_token_ids: tuple[int, ...]) -> TensorParallelExecutor:
    """Spawns ranks 1.., joins the group as rank 0, makes rank 0's shard row-parallel; returns the executor
    once every rank is ready. Each rank gets an equal share of this process's threads."""
    world = args.tensor_parallel_size
    threads = max(1, (os.cpu_count() or world) // world)
    spec = WorkerSpec(rank=0, world_size=world, init_method=free_tcp_address(), load_kwargs=tp_load_kwargs(args),
                      kv_cache_dtype=args.kv_cache_dtype, num_blocks=num_blocks, block_size=args.block_size,
                      max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                      attention_backend=args.attention_backend, eos_token_ids=eos_token_ids, num_threads=threads)
    connections, processes = TensorParallelExecutor.start_workers(spec)
    TensorParallelExecutor.wait_alive(connections, processes)
    torch.set_num_threads(threads)
    group = TPGroup.join(0, world, spec.init_method)
    runner = build_rank(loaded, group, spec)
    executor = TensorParallelExecutor(runner, connections, processes, group)
    executor.wait_ready()
    return executor
