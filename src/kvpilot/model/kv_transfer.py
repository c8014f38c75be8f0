"""Disaggregation's copies between the paged KV cache and bytes on the wire (engine/kv_transfer.py has the contract,
docs/disaggregation.md the layout), and between GPU workers of one host through CUDA IPC (CudaIpcShare).

Wire layout of one block: [num_layers, 2 (K then V), kv_heads, block_size, head_dim] in the cache's dtype, C order,
the same as a KV offload tier slot (model/kv_offload.py); n blocks are n such runs back to back, in the order of
the block ids asked for. `read_blocks` runs on the KV sender's thread while the step loop runs: it only reads
blocks the KV manager holds for a finished request, which no step writes; `write_blocks` runs in the step that
admits the decode request, before its forward.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvpilot.model.kv_offload import _gather, _scatter

logger = logging.getLogger("kvpilot")


def kv_layout(kv_caches: Sequence[torch.Tensor]) -> dict[str, Any]:
    """What both sides of a transfer must agree on (the handshake compares it field by field)."""
    two, heads, _, block_size, head_dim = kv_caches[0].shape
    return {"num_layers": len(kv_caches), "num_kv_heads": int(heads), "block_size": int(block_size),
            "head_dim": int(head_dim), "dtype": str(kv_caches[0].dtype).removeprefix("torch."),
            "bytes_per_block": len(kv_caches) * two * heads * block_size * head_dim * kv_caches[0].element_size()}


@torch.inference_mode()
def read_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> memoryview:
    """The blocks' K/V of every layer, in the wire layout (a view of one host copy, for socket.sendall)."""
    data = _gather(kv_caches, list(block_ids)).contiguous().cpu()
    return memoryview(data.view(torch.uint8).reshape(-1).numpy())


@torch.inference_mode()
def write_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                 data: bytes | bytearray | torch.Tensor) -> None:
    """Writes len(block_ids) blocks of wire-layout bytes (or a tensor of that layout, CudaIpcShare.pull's) into those
    blocks of every layer's cache."""
    first = kv_caches[0]
    if isinstance(data, torch.Tensor):
        if data.device.type == "cuda":  # gathered on the puller's stream: not reused until this one is done
            data.record_stream(torch.cuda.current_stream(data.device))
        _scatter(kv_caches, list(block_ids), data.to(first.device))
        return
    two, heads, _, block_size, head_dim = first.shape
    writable = data if isinstance(data, bytearray) else bytearray(data)  # frombuffer wants a writable buffer
    raw = torch.frombuffer(writable, dtype=torch.uint8).view(first.dtype)
    blocks = raw.reshape(len(block_ids), len(kv_caches), two, heads, block_size, head_dim)
    _scatter(kv_caches, list(block_ids), blocks.to(first.device))


class CudaIpcShare:
    """The same-host transport between GPU workers (`cuda_ipc`): the sender exports its KV caches' CUDA IPC handles
    once (descriptor(), JSON: no pickle crosses the wire); a puller opens a sender's caches once (by engine id) and
    gathers the held blocks device to device on a stream of its own, instead of two PCIe copies and a socket.

    Invariants: the sender's caches live as long as its engine (the handles stay valid); a pull reads only blocks
    the sender holds for it, whose writes completed before the request finished; the gathered tensor is ready
    (its stream synchronized) when pull() returns, and write_blocks guards its memory for the step's stream."""

    name = "cuda_ipc"
    MAX_OPEN_SENDERS = 8

    def __init__(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self.kv_caches = list(kv_caches)
        self.device = self.kv_caches[0].device
        self._descriptor: dict[str, Any] | None = None
        self._opened: dict[str, list[torch.Tensor]] = {}
        self._stream: torch.cuda.Stream | None = None

    def descriptor(self) -> dict[str, Any]:
        """What a puller needs to open this worker's caches: the device's UUID and one handle set per layer."""
        if self._descriptor is None:
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            self._descriptor = {"device_uuid": uuid, "caches": [_export(cache) for cache in self.kv_caches]}
        return self._descriptor

    @torch.inference_mode()
    def pull(self, engine_id: str, descriptor: dict[str, Any], block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks of the sender `engine_id` as [n, num_layers, 2, kv_heads, block_size, head_dim] on this
        worker's device (ValueError when the sender's GPU is not visible here: the caller recomputes)."""
        caches = self._opened.get(engine_id)
        if caches is None:
            device = _local_device(str(descriptor["device_uuid"]))
            caches = [_open(entry, device) for entry in descriptor["caches"]]
            logger.info("KV pulls from %s: over CUDA IPC (GPU %d), device to device", engine_id, device)
            if len(self._opened) >= self.MAX_OPEN_SENDERS:  # restarted senders' mappings are dropped
                self._opened.pop(next(iter(self._opened)))
            self._opened[engine_id] = caches
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            gathered = _gather(caches, list(block_ids)).to(self.device).contiguous()
        self._stream.synchronize()
        expected = (len(block_ids), len(self.kv_caches), *self.kv_caches[0].shape[:2], *self.kv_caches[0].shape[3:])
        if tuple(gathered.shape) != expected or gathered.dtype != self.kv_caches[0].dtype:  # never into the cache
            raise ValueError(f"the prefill worker's caches give blocks of {tuple(gathered.shape)} {gathered.dtype}, "
                             f"this worker's are {expected} {self.kv_caches[0].dtype}")
        return gathered


def device_share_for(kv_caches: Sequence[torch.Tensor]) -> CudaIpcShare | None:
    """The same-host device transport for these caches (CUDA: CudaIpcShare), None where blocks travel as bytes."""
    return CudaIpcShare(kv_caches) if kv_caches[0].device.type == "cuda" else None


def _export(cache: torch.Tensor) -> dict[str, Any]:
    """One cache tensor's CUDA IPC handle set, as torch.multiprocessing shares it, in JSON-safe fields."""
    storage = cache._typed_storage()
    (_, handle, size_bytes, offset_bytes, counter_handle, counter_offset, event_handle,
     event_sync) = storage._share_cuda_()
    return {"size": list(cache.shape), "stride": list(cache.stride()), "offset": cache.storage_offset(),
            "dtype": str(cache.dtype).removeprefix("torch."), "handle": _b64(handle), "size_bytes": size_bytes,
            "offset_bytes": offset_bytes, "counter_handle": _b64(counter_handle), "counter_offset": counter_offset,
            "event_handle": _b64(event_handle), "event_sync": bool(event_sync)}


def _open(entry: dict[str, Any], device: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = getattr(torch, str(entry["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {entry['dtype']!r}")
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(entry["size"]), tuple(entry["stride"]), entry["offset"],
                               torch.storage.TypedStorage, dtype, device, _unb64(entry["handle"]),
                               entry["size_bytes"], entry["offset_bytes"], False, _unb64(entry["counter_handle"]),
                               entry["counter_offset"], _unb64(entry["event_handle"]), entry["event_sync"])


def _local_device(uuid: str) -> int:
    """This process's index of the GPU with `uuid`; ValueError when it is not visible here."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise ValueError(f"the prefill worker's GPU {uuid} is not visible to this worker (CUDA_VISIBLE_DEVICES)")


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _unb64(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)
