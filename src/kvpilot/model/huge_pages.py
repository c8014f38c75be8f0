"""Transparent huge pages for large CPU tensors read at scattered places (the paged KV cache).

A decode step reads each sequence's K/V blocks (2 KiB each for the embedded model) wherever the block pool put
them; in a running server they are scattered over the whole cache, so with 4 KiB pages nearly every block read
is a TLB miss and a page walk. On 2 MiB pages the cache is a few hundred TLB entries. Linux gives a region huge
pages when the system's THP mode is `always`, or `madvise` (a common default) and the region was advised
before its first touch: what `advise_huge_pages` does. Advisory only: nothing changes where THP is off or
the call is not available (other systems), and the tensor's contents and layout are the same either way.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE_PAGE_BYTES = 2 * 1024 * 1024


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks the kernel for huge pages under the 2 MiB-aligned part of a CPU tensor's memory; call it before the
    tensor is first written. True if the kernel took the advice (not whether pages were available)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return False
    address = tensor.data_ptr()
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + tensor.numel() * tensor.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return False
    madvise = _libc_madvise()
    return madvise is not None and madvise(start, end - start, advice) == 0


def _libc_madvise():  # noqa: ANN202 - a ctypes function or None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # no libc symbols in this process (an unusual build)
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function
