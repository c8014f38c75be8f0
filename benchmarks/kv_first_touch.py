"""The cost of writing K/V into never-used blocks of the CPU KV cache: a 128-token prompt's K and V written into
fresh blocks of a cache shaped like the embedded model's (30 layers x [2, 3 heads, blocks, 16, 64] bf16; the
first write of a page of the anonymous mapping faults it in), then into the same blocks again; with the cache
on 4 KiB pages (kvpilot's since 2026-12-02) and advised to 2 MiB pages (`madvise(MADV_HUGEPAGE)` before the
first write, as kvpilot did before). Prints the median microseconds a layer's write for each.

    .venv/bin/python benchmarks/kv_first_touch.py
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import mmap
import statistics
import time

import torch

importlib.import_module("kvpilot.model.attention")  # before paged_attention, which it imports (a cycle otherwise)
from kvpilot.model.kv_cache import allocate_kv_cache  # noqa: E402
from kvpilot.model.layers.paged_attention import write_kv  # noqa: E402

HUGE_PAGE = 2 * 2**20


def advise_huge(cache: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned part of the cache (before its first write)."""
    start = -(-cache.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (cache.data_ptr() + cache.numel() * cache.element_size()) // HUGE_PAGE * HUGE_PAGE
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return end > start and madvise(start, end - start, getattr(mmap, "MADV_HUGEPAGE", 14)) == 0


def measure(num_blocks: int, prompts: int, huge: bool) -> tuple[float, float]:
    """Median us a layer's write of a 128-token prompt: into fresh blocks, then into the same blocks again."""
    caches = allocate_kv_cache((2, 3, num_blocks, 16, 64), 30, torch.bfloat16, torch.device("cpu"))
    if huge and not all(advise_huge(c) for c in caches):
        raise SystemExit("no whole 2 MiB page to advise in a layer's cache (--blocks too few), or madvise refused it")
    k, v = torch.randn(128, 3, 64, dtype=torch.bfloat16), torch.randn(128, 3, 64, dtype=torch.bfloat16)

    def write(prompt: int) -> float:
        slots = torch.arange(128) + (8 * prompt + 1) * 16  # 8 blocks a prompt, block 0 left out as kvpilot's
        start = time.perf_counter()
        for cache in caches:
            write_kv(cache, k, v, slots)
        return (time.perf_counter() - start) / len(caches) * 1e6

    fresh = [write(p) for p in range(prompts)]
    again = [write(p) for p in range(prompts)]
    return statistics.median(fresh), statistics.median(again)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=5825, help="blocks of the cache (the server's default here)")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for huge in (False, True):
            fresh, again = measure(args.blocks, args.prompts, huge)
            pages = "2 MiB pages advised" if huge else "4 KiB pages"
            print(f"{pages}: fresh blocks {fresh:.0f} us a layer's write, the same blocks again {again:.0f} us")


if __name__ == "__main__":
    main()
