"""KVOffloadStore: the storage of the KV offload tiers (engine/kv_offload.py keeps their bookkeeping) and the copies
between them and the paged KV cache, as the scheduler orders them (SchedulerOutput.offload).

Layout: a tier slot holds one block of every layer, [num_layers, 2, kv_heads, block_size, head_dim] in the
cache's dtype (the caches are [2, kv_heads, num_blocks, block_size, head_dim] per layer: model/kv_cache.py), so
one slot is one contiguous run of bytes_per_block bytes. The host tier is one tensor of num_host_slots such
slots: pinned host memory on CUDA, plain RAM on CPU (a pool apart from the KV cache, which --kv-cache-memory
bounds). The disk tier is one file of num_disk_slots slots in --kv-offload-dir, memory-mapped and unlinked at
once (nothing is left behind when the process ends; the page cache holds what the kernel has not written out).

Copies (execute): demotes (host -> disk), saves (cache -> host), disk saves (cache -> disk), then loads (host ->
cache) and disk loads (disk -> cache), each list as one batch, all before the step's forward: on CPU in the
engine thread; on CUDA queued on the compute stream (gather/scatter kernels on the device, pinned-memory DMA
between, one transfer per run of consecutive slots), so they do not block the host. Disk traffic on CUDA
synchronizes the stream first (the host reads or writes pinned slots that queued copies may still be using).

Beside loads (start_beside: a waiting request's prefetch, engine/kv_manager.py) overlap the step's forward, which
never reads their blocks: on CPU a copy thread runs them while the engine thread computes, and the runner waits
for it before the step returns; on CUDA they run on a side stream that first waits for the step's saves (which
read blocks these loads overwrite), and the compute stream waits for them before anything queued after the step.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.engine.kv_offload import OffloadOrders


@dataclass(frozen=True)
class OffloadSpec:
    """The tiers a runner allocates (picklable: tensor-parallel ranks each allocate their own share)."""

    num_host_slots: int
    num_disk_slots: int = 0
    disk_dir: str | None = None


class KVOffloadStore:
    """Owns the tiers' memory; `execute` carries out one step's copy orders against `kv_caches`."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], spec: OffloadSpec) -> None:
        first = kv_caches[0]
        two, heads, _, block_size, head_dim = first.shape
        self.device = first.device
        self.dtype = first.dtype
        self.slot_shape = (len(kv_caches), two, heads, block_size, head_dim)
        self.host = torch.empty((spec.num_host_slots, *self.slot_shape), dtype=first.dtype,
                                pin_memory=self.device.type == "cuda")
        self.bytes_per_slot = self.host[0].numel() * self.host.element_size() if spec.num_host_slots else 0
        self._disk: np.memmap | None = None
        if spec.num_disk_slots:
            self._disk = _disk_file(spec.disk_dir, spec.num_disk_slots, self.bytes_per_slot)

        self._copier: ThreadPoolExecutor | None = None  # CPU: the thread beside loads run in
        self._side_stream: torch.cuda.Stream | None = None  # CUDA: the stream beside loads run on

    @property
    def num_host_bytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def start_beside(self, kv_caches: Sequence[torch.Tensor], orders: OffloadOrders) -> "BesideCopy":
        """Starts the step's beside loads (after execute() ran its orders); wait() on the result before the
        step returns."""
        if self.device.type == "cuda":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
            compute = torch.cuda.current_stream(self.device)
            self._side_stream.wait_stream(compute)  # after the saves: they read blocks these loads overwrite
            with torch.cuda.stream(self._side_stream):
                self._beside_loads(kv_caches, orders)
                done = torch.cuda.Event()
                done.record(self._side_stream)
            return BesideCopy(lambda: compute.wait_event(done) or 0.0)
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvpilot-kv-load")
        future: Future[float] = self._copier.submit(self._beside_loads_inference, kv_caches, orders)
        return BesideCopy(future.result)

    def _beside_loads_inference(self, kv_caches: Sequence[torch.Tensor], orders: OffloadOrders) -> float:
        """The copy thread's work; returns its seconds (the KV manager paces later prefetches by them). Host
        loads are numpy copies on this one thread: torch's would open a second OpenMP team beside the forward's,
        and on a CPU whose cores the forward fills each team then waits for the other at every barrier."""
        start = time.perf_counter()
        if orders.beside_loads:
            slots, blocks = _columns(orders.beside_loads)
            _scatter_numpy(kv_caches, blocks, _int_view(self.host)[slots])
        if orders.beside_disk_loads:
            with torch.inference_mode():  # thread-local: the caches are inference tensors
                self._disk_load(kv_caches, orders.beside_disk_loads)
        return time.perf_counter() - start

    def _beside_loads(self, kv_caches: Sequence[torch.Tensor], orders: OffloadOrders) -> None:
        if orders.beside_loads:
            self._load(kv_caches, orders.beside_loads)
        if orders.beside_disk_loads:
            self._disk_load(kv_caches, orders.beside_disk_loads)

    def execute(self, kv_caches: Sequence[torch.Tensor], orders: OffloadOrders) -> None:
        """The step's copies, in the order engine/kv_offload.py fixes (each list read before it is written)."""
        cuda = self.device.type == "cuda"
        if cuda and (orders.demotes or orders.disk_saves or orders.disk_loads):
            torch.cuda.current_stream(self.device).synchronize()  # the host touches pinned slots below
        if orders.demotes:
            host, disk = _columns(orders.demotes)
            self._disk_array()[disk] = self._host_bytes()[host]
        if orders.saves:
            self._save(kv_caches, orders.saves)
        if orders.disk_saves:
            blocks, disk = _columns(orders.disk_saves)
            data = _gather(kv_caches, blocks).contiguous().cpu()
            self._disk_array()[disk] = data.view(torch.uint8).reshape(len(disk), -1).numpy()
        if orders.loads:
            self._load(kv_caches, orders.loads)
        if orders.disk_loads:
            self._disk_load(kv_caches, orders.disk_loads)

    def _disk_load(self, kv_caches: Sequence[torch.Tensor], disk_loads: list[tuple[int, int]]) -> None:
        disk, blocks = _columns(disk_loads)
        raw = torch.from_numpy(np.ascontiguousarray(self._disk_array()[disk]))
        data = raw.view(self.dtype).reshape(len(disk), *self.slot_shape)
        _scatter(kv_caches, blocks, data.to(self.device))

    def _save(self, kv_caches: Sequence[torch.Tensor], saves: list[tuple[int, int]]) -> None:
        if self.device.type != "cuda":
            blocks, slots = _columns(saves)
            self.host.index_copy_(0, torch.tensor(slots), _gather(kv_caches, blocks))
            return
        saves = sorted(saves, key=lambda pair: pair[1])  # runs of consecutive slots: one transfer each
        blocks, slots = _columns(saves)
        gathered = _gather(kv_caches, blocks).contiguous()
        for start, end in _runs(slots):
            self.host[slots[start]:slots[start] + end - start].copy_(gathered[start:end], non_blocking=True)

    def _load(self, kv_caches: Sequence[torch.Tensor], loads: list[tuple[int, int]]) -> None:
        if self.device.type != "cuda":
            slots, blocks = _columns(loads)
            _scatter(kv_caches, blocks, self.host.index_select(0, torch.tensor(slots)))
            return
        loads = sorted(loads)
        slots, blocks = _columns(loads)
        staged = torch.empty((len(slots), *self.slot_shape), dtype=self.dtype, device=self.device)
        for start, end in _runs(slots):
            staged[start:end].copy_(self.host[slots[start]:slots[start] + end - start], non_blocking=True)
        _scatter(kv_caches, blocks, staged)

    def _host_bytes(self) -> np.ndarray:
        return self.host.view(torch.uint8).reshape(self.host.shape[0], -1).numpy()

    def _disk_array(self) -> np.memmap:
        if self._disk is None:
            raise RuntimeError("a disk offload order, but this runner has no disk tier")
        return self._disk


class BesideCopy:
    """Beside loads in progress: wait() returns once later work of the step's device sees them (CPU: the copy
    thread finished, re-raising its error; CUDA: the compute stream waits for them, the host does not), with
    the copy's seconds (CUDA: 0, not timed)."""

    def __init__(self, wait: Callable[[], float]) -> None:
        self._wait = wait

    def wait(self) -> float:
        return self._wait()


def _disk_file(directory: str | None, num_slots: int, bytes_per_slot: int) -> np.memmap:
    """A memory-mapped file of num_slots slots in `directory`, unlinked at once (it lives while mapped)."""
    os.makedirs(directory or ".", exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="kvpilot-kv-offload-", suffix=".bin", dir=directory)
    try:
        os.ftruncate(fd, num_slots * bytes_per_slot)
        return np.memmap(path, dtype=np.uint8, mode="r+", shape=(num_slots, bytes_per_slot))
    finally:
        os.close(fd)
        os.unlink(path)


def _columns(pairs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [a for a, _ in pairs], [b for _, b in pairs]


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges of `slots` whose values go up by one (slots sorted)."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    """ids on `device`; on CUDA through pinned memory, queued on the stream (no wait for the step in flight)."""
    index = torch.tensor(ids, dtype=torch.int64)
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def _gather(kv_caches: Sequence[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """[n, num_layers, 2, kv_heads, block_size, head_dim]: the blocks' K/V of every layer (a view of a copy)."""
    index = _index(block_ids, kv_caches[0].device)
    return torch.stack([cache.index_select(2, index) for cache in kv_caches]).permute(3, 0, 1, 2, 4, 5)


def _int_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a numpy array of same-size integers (numpy has no bf16 or fp8)."""
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()]
    return tensor.view(dtype).numpy()


def _scatter_numpy(kv_caches: Sequence[torch.Tensor], block_ids: list[int], data: np.ndarray) -> None:
    """_scatter with numpy on the calling thread: data [n, num_layers, 2, kv_heads, block_size, head_dim]."""
    for layer, cache in enumerate(kv_caches):
        _int_view(cache)[:, :, block_ids] = data[:, layer].transpose(1, 2, 0, 3, 4)


def _scatter(kv_caches: Sequence[torch.Tensor], block_ids: list[int], data: torch.Tensor) -> None:
    """Writes data [n, num_layers, 2, kv_heads, block_size, head_dim] into the blocks of every layer's cache."""
    index = _index(block_ids, kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(2, index, data[:, layer].permute(1, 2, 0, 3, 4))
