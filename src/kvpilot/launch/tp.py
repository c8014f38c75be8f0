"""Building the tensor-parallel side of an engine (tensor_parallel_size > 1), in three phases around the KV
sizing: `TPLaunch.start` spawns ranks 1.. and loads every rank's shard at once (on CUDA one GPU a rank,
NCCL; on CPU gloo), `kv_budget` profiles every GPU at once (the layers' all-reduces pair the forwards up) and
takes the smallest, `executor` builds every rank's runner over the same number of blocks."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed

from kvpilot.engine.config import EngineConfigError
from kvpilot.launch.args import EngineArgs
from kvpilot.model.config import ModelConfig
from kvpilot.model.loader import LoadedModel
from kvpilot.model.parallel.executor import TensorParallelExecutor, WorkerPool, free_tcp_address
from kvpilot.model.parallel.group import PlacementError, TPGroup, rank_device
from kvpilot.model.parallel.worker import KVBudgetRequest, RunnerSpec, WorkerSpec, build_rank, load_rank, \
    rank_kv_budget


def tp_load_kwargs(args: EngineArgs) -> dict:
    """load_model's arguments for every rank but its tp_rank and device: the same weights (dummy draws are
    seeded), always dense, each rank reading only its shard."""
    return dict(model=args.model, load_format=args.load_format, dtype=args.dtype,
                max_model_len=args.max_model_len, seed=args.seed, quantization="none",
                prompt_gemm_dtype=args.prompt_gemm_dtype, tp_size=args.tensor_parallel_size)


def rank_config(loaded: LoadedModel) -> ModelConfig:
    """The config one rank's KV cache is sized by (its KV heads)."""
    return loaded.config if loaded.shard is None else loaded.shard.local_config


@dataclass
class TPLaunch:
    """Rank 0's side of a start: the workers (loaded), the group, rank 0's shard, and the process's torch thread
    count before rank 0 took its share (put back at shutdown). `abort` undoes it all."""

    workers: WorkerPool
    group: TPGroup
    loaded: LoadedModel
    num_threads_before: int

    @classmethod
    def start(cls, args: EngineArgs, loaded: LoadedModel | None) -> TPLaunch:
        """Every rank joined and loaded; a model that does not split fails here naming the sizes that work
        (ModelLoadError), a placement that cannot work with EngineConfigError saying what to change."""
        world = args.tensor_parallel_size
        if torch.distributed.is_initialized():
            raise EngineConfigError("another tensor-parallel engine is running in this process: shut it down "
                                    "first (engine.runner.shutdown()); torch.distributed has one default group "
                                    "per process")
        if loaded is not None:
            raise EngineConfigError("tensor parallelism loads its own shards on every rank: pass the model, not "
                                    "an already loaded one")
        try:
            rank_device(args.device, world - 1, world)
        except PlacementError as exc:
            raise EngineConfigError(str(exc)) from exc
        threads = max(1, (os.cpu_count() or world) // world)  # each rank an equal share of the CPU's threads
        spec = WorkerSpec(rank=0, world_size=world, init_method=free_tcp_address(), load_kwargs=tp_load_kwargs(args),
                          device=args.device, num_threads=threads)
        workers = WorkerPool(spec)
        group = None
        num_threads_before = torch.get_num_threads()
        try:
            workers.wait_alive()
            torch.set_num_threads(threads)
            group, loaded = load_rank(spec)
            workers.gather("loaded", "loading its shard")
        except BaseException:
            _abort(workers, group, num_threads_before)
            raise
        return cls(workers, group, loaded, num_threads_before)

    def kv_budget(self, request: KVBudgetRequest) -> int:
        """CUDA: every rank's budget from its own GPU, measured at once; the smallest (every rank's cache holds
        the same blocks)."""
        self.workers.send_all("kv_budget", request)
        own = rank_kv_budget(self.loaded, request)
        return min([own, *self.workers.gather("kv_budget", "profiling its KV budget")])

    def executor(self, spec: RunnerSpec) -> TensorParallelExecutor:
        self.workers.send_all("build", spec)
        runner = build_rank(self.loaded, self.group, spec)
        self.workers.gather("ready", "building its runner")
        return TensorParallelExecutor(runner, self.workers, self.group, self.num_threads_before)

    def abort(self) -> None:
        _abort(self.workers, self.group, self.num_threads_before)


def _abort(workers: WorkerPool, group: TPGroup | None, num_threads_before: int) -> None:
    workers.kill()
    if group is not None:
        group.leave()
    torch.set_num_threads(num_threads_before)
