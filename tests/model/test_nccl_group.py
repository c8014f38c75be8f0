"""The tensor-parallel group over NCCL, on a GPU (issue #48: the single-GPU machine runs one rank): joining,
all_reduce and broadcast in place, and leaving. On a CPU it is skipped; the same group over gloo with two ranks
is what tests/model/test_tensor_parallel.py runs everywhere. benchmarks/gpu_checks.sh runs this file."""

from __future__ import annotations

import pytest
import torch

from kvpilot.model.parallel.executor import free_tcp_address
from kvpilot.model.parallel.group import TPGroup, backend_for, rank_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA GPU")


def test_one_rank_over_nccl_reduces_and_broadcasts_in_place() -> None:
    device = rank_device("cuda", 0, 1)
    assert backend_for(device) == "nccl"
    group = TPGroup.join(0, 1, free_tcp_address(), device)
    try:
        x = torch.arange(8, dtype=torch.bfloat16, device=device)
        before = x.data_ptr()
        assert torch.equal(group.all_reduce(x), torch.arange(8, dtype=torch.bfloat16, device=device))
        assert x.data_ptr() == before
        y = torch.full((4,), 3.0, device=device)
        assert torch.equal(group.broadcast(y), torch.full((4,), 3.0, device=device))
        torch.cuda.synchronize()
    finally:
        group.leave()
    assert not torch.distributed.is_initialized()
