"""The KV cache on CPU asks for transparent huge pages (kvpilot.model.huge_pages): advice only, so what must
hold everywhere is that the cache is the same zeroed tensor either way, and where this Linux takes the advice
the 2 MiB-aligned part of the cache is what was advised."""

from __future__ import annotations

import ctypes
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from kvpilot.model import huge_pages
from kvpilot.model.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages
from kvpilot.model.kv_cache import allocate_kv_cache


def test_a_tensor_smaller_than_one_aligned_huge_page_is_not_advised() -> None:
    assert advise_huge_pages(torch.empty(HUGE_PAGE_BYTES // 8, dtype=torch.uint8)) is False


def test_the_advised_range_is_the_aligned_part_of_the_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(huge_pages, "_libc_madvise", lambda: lambda start, length, advice: calls.append(
        (start, length, advice)) or 0)
    if not sys.platform.startswith("linux") or not hasattr(huge_pages.mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE here")
    tensor = torch.empty(5 * HUGE_PAGE_BYTES + 12345, dtype=torch.uint8)
    assert advise_huge_pages(tensor) is True
    (start, length, advice), = calls
    end = tensor.data_ptr() + tensor.numel()
    assert start % HUGE_PAGE_BYTES == 0 and length % HUGE_PAGE_BYTES == 0 and length >= 4 * HUGE_PAGE_BYTES
    assert tensor.data_ptr() <= start < tensor.data_ptr() + HUGE_PAGE_BYTES and start + length <= end
    assert end - (start + length) < HUGE_PAGE_BYTES and advice == huge_pages.mmap.MADV_HUGEPAGE


def test_the_cpu_kv_cache_is_zeroed_and_shaped_as_asked() -> None:
    caches = allocate_kv_cache((2, 3, 512, 16, 64), 2, torch.bfloat16, torch.device("cpu"))
    assert [c.shape for c in caches] == [torch.Size([2, 3, 512, 16, 64])] * 2
    assert all(c.dtype == torch.bfloat16 and c.is_contiguous() and not c.any() for c in caches)


def _resident_mib(tensor: torch.Tensor) -> float:
    """Resident memory under `tensor`'s bytes (mincore), whatever the rest of this process holds or frees: the
    process's RSS dropped 441 MiB during this test once, another test's memory going away beside it."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = (ctypes.c_ubyte * -(-length // page))()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(p & 1 for p in pages) * page / 2**20


def test_the_cpu_kv_cache_takes_memory_only_where_it_is_written() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("reads residency with Linux's mincore")
    caches = allocate_kv_cache((2, 3, 4096, 16, 64), 4, torch.bfloat16, torch.device("cpu"))  # 4 x 48 MiB
    assert sum(_resident_mib(c) for c in caches) < 16  # start-up writes none of it
    caches[0][:, :, :64].fill_(1.0)  # the first 64 blocks of one layer (~1.5 MiB, plus its huge pages)
    assert 1 <= _resident_mib(caches[0]) < 40 and sum(_resident_mib(c) for c in caches[1:]) < 16
    assert not caches[1].any()


def test_where_linux_takes_the_advice_the_cache_gets_huge_pages() -> None:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off or absent here")

    def huge_kib() -> int:
        return int(re.search(r"AnonHugePages:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text()).group(1))

    before = huge_kib()
    caches = allocate_kv_cache((2, 1, 2048, 16, 128), 1, torch.float32, torch.device("cpu"))  # 32 MiB
    caches[0].fill_(1.0)  # pages are given at the first write
    # the kernel may find no free huge page (fragmented memory): at least it must not have refused the advice
    assert huge_kib() > before or advise_huge_pages(torch.empty(8 * HUGE_PAGE_BYTES, dtype=torch.uint8))
    del caches
