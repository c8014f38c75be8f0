"""The tensor-parallel process group: one rank per process, gloo on CPU and NCCL on CUDA (one GPU a rank),
joined over a loopback TCP address. torch.distributed keeps the default group process-wide; this object is
what the layers and the runner are handed, so nothing reaches for it implicitly."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a dead rank fails the step after this, not never


class PlacementError(ValueError):
    """The ranks cannot be placed on this machine's devices; the message says what to change."""


def rank_device(device: str | None, rank: int, world_size: int) -> str:
    """The device rank `rank` computes on: the CPU for every rank, or CUDA GPU `first + rank` where `device`
    names GPU `first` ("cuda" is GPU 0). PlacementError when the machine has too few GPUs."""
    base = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if base.type != "cuda":
        return str(base)
    first = base.index or 0
    available = torch.cuda.device_count()
    if first + world_size > available:
        raise PlacementError(f"tensor_parallel_size={world_size} needs GPUs {first}..{first + world_size - 1}, "
                             f"one a rank; this machine has {available}: lower --tensor-parallel-size")
    return f"cuda:{first + rank}"


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world_size: int

    @classmethod
    def join(cls, rank: int, world_size: int, init_method: str, device: str = "cpu") -> "TPGroup":
        """Blocks until every rank has joined; a CUDA rank makes its GPU the current one first (NCCL's)."""
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, world_size)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place (every rank gets the same bits)."""
        dist.all_reduce(tensor)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(tensor, src)
        return tensor

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
