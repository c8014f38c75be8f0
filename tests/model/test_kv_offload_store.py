"""KVOffloadStore (model/kv_offload.py) on CPU: blocks saved to the host tier, demoted and saved to the disk tier,
come back bit for bit into other blocks of every layer's cache, in the order the copy orders fix."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.kv_offload import OffloadOrders
from kvpilot.model.kv_offload import KVOffloadStore, OffloadSpec, _runs


def _caches(dtype: torch.dtype, num_blocks: int = 6) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, 3, num_blocks, 4, 8).to(dtype) for _ in range(2)]  # [2, heads, blocks, bs, dim]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_round_trip_through_both_tiers(dtype: torch.dtype, tmp_path) -> None:
    caches = _caches(dtype)
    original = [c.clone() for c in caches]
    store = KVOffloadStore(caches, OffloadSpec(num_host_slots=2, num_disk_slots=3, disk_dir=str(tmp_path)))
    assert store.bytes_per_slot == 2 * 2 * 3 * 4 * 8 * caches[0].element_size()
    assert list(tmp_path.iterdir()) == []  # the disk tier's file is unlinked at once
    store.execute(caches, OffloadOrders(saves=[(1, 1), (3, 0)], disk_saves=[(4, 2)]))
    for cache in caches:
        cache.zero_()  # the blocks are reused for other data
    # next step: host slot 0 (block 3) is demoted before slot 0 is overwritten by block 5's save
    store.execute(caches, OffloadOrders(demotes=[(0, 0)], saves=[(5, 0)]))
    store.execute(caches, OffloadOrders(loads=[(1, 0), (0, 2)], disk_loads=[(0, 4), (2, 5)]))
    for cache, before in zip(caches, original):
        assert torch.equal(cache[:, :, 0], before[:, :, 1])  # host slot 1: block 1
        assert torch.equal(cache[:, :, 4], before[:, :, 3])  # disk slot 0: block 3, demoted
        assert torch.equal(cache[:, :, 5], before[:, :, 4])  # disk slot 2: block 4, saved straight to disk
        assert not cache[:, :, 2].any()  # host slot 0 now holds block 5, saved after the caches were zeroed


def test_beside_loads_run_in_the_copy_thread_into_inference_caches(tmp_path) -> None:
    with torch.inference_mode():  # as the runner's caches are: the copy thread must enter the mode itself
        caches = _caches(torch.bfloat16)
    original = [c.clone() for c in caches]
    store = KVOffloadStore(caches, OffloadSpec(num_host_slots=2, num_disk_slots=2, disk_dir=str(tmp_path)))
    store.execute(caches, OffloadOrders(saves=[(1, 0)], disk_saves=[(2, 1)]))
    with torch.inference_mode():
        for cache in caches:
            cache.zero_()
        beside = store.start_beside(caches, OffloadOrders(beside_loads=[(0, 4)], beside_disk_loads=[(1, 5)]))
        beside.wait()
    for cache, before in zip(caches, original):
        assert torch.equal(cache[:, :, 4], before[:, :, 1]) and torch.equal(cache[:, :, 5], before[:, :, 2])
        assert not cache[:, :, :4].any()


def test_runs_of_consecutive_slots() -> None:
    assert _runs([0, 1, 2, 5, 6, 9]) == [(0, 3), (3, 5), (5, 6)]
    assert _runs([]) == []
