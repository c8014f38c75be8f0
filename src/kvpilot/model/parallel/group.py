"""The tensor-parallel process group: one rank per process, gloo on CPU (NCCL would be CUDA's), joined over
a loopback TCP address. torch.distributed keeps the default group process-wide; this object is what the
layers and the runner are handed, so nothing reaches for it implicitly."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a dead rank fails the step after this, not never


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world_size: int

    @classmethod
    def join(cls, rank: int, world_size: int, init_method: str) -> "TPGroup":
        """Blocks until every rank has joined."""
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
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
