"""KV offload's tiers in blocks, from --kv-offloading-size / --kv-offload-dir(-size) and the cache's bytes per
block (engine/kv_offload.py keeps the tiers' bookkeeping, model/kv_offload.py their memory)."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

from kvpilot.engine.config import EngineConfigError
from kvpilot.launch.args import EngineArgs
from kvpilot.memory_size import format_bytes
from kvpilot.model.kv_offload import OffloadSpec

logger = logging.getLogger("kvpilot")


@dataclass(frozen=True)
class OffloadPlan:
    """Tier sizes in blocks (a rank's share under tensor parallelism: the flags give the total, as vLLM's)."""

    num_host_blocks: int
    num_disk_blocks: int = 0
    disk_dir: str | None = None

    @property
    def spec(self) -> OffloadSpec:
        return OffloadSpec(self.num_host_blocks, self.num_disk_blocks, self.disk_dir)


def plan_offload(args: EngineArgs, bytes_per_block: int, group_windows: tuple[int | None, ...],
                 pinned: bool) -> OffloadPlan | None:
    """None when offload is off, or (INFO line) for a model with sliding-window layers (group_windows: the
    KV groups' windows, engine/kv_groups.py): their blocks leave the window and are freed, and the tiers keep
    one group's blocks. EngineConfigError for a tier too small to hold one block, or a disk tier larger than
    the free space of its folder."""
    host_bytes, disk_bytes = args.kv_offload_bytes()
    if not host_bytes:
        return None
    if any(window is not None for window in group_windows):
        logger.info("KV offload off: %s of this model attend%s to a sliding window, and blocks that leave it "
                    "are freed, not cached", "every layer" if len(group_windows) == 1 else "some layers",
                    "s" if len(group_windows) == 1 else "")
        return None
    ranks = args.tensor_parallel_size
    num_host = host_bytes // ranks // bytes_per_block
    if num_host < 1:
        raise EngineConfigError(f"kv_offloading_size {format_bytes(host_bytes)} holds no KV block of "
                                f"{format_bytes(bytes_per_block * ranks)}: raise it")
    num_disk = disk_bytes // ranks // bytes_per_block
    if disk_bytes:
        _check_disk(args.kv_offload_dir or ".", disk_bytes)
    logger.info("KV offload: a host tier of %d blocks (%s%s)%s", num_host, format_bytes(num_host * bytes_per_block),
                ", pinned" if pinned else "", f", a disk tier of {num_disk} blocks ({format_bytes(num_disk * bytes_per_block)}) "
                f"in {args.kv_offload_dir}" if num_disk else "")
    return OffloadPlan(num_host, num_disk, args.kv_offload_dir if num_disk else None)


def _check_disk(directory: str, num_bytes: int) -> None:
    os.makedirs(directory, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if num_bytes > free:
        raise EngineConfigError(f"kv_offload_dir_size {format_bytes(num_bytes)} exceeds the {format_bytes(free)} "
                                f"free in {directory}: lower it")
