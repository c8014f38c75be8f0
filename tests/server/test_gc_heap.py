"""freeze_startup_heap (server processes only): in a fresh interpreter, since frozen objects are never
collected and the test process builds and drops many engines."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import gc
import weakref
from kvpilot.server.gc_heap import freeze_startup_heap
import kvpilot.server.app  # a server process's start-up heap: FastAPI, pydantic models, the app's modules
class Node:
    pass
node = Node()
node.itself = node  # a cycle dropped before the freeze: collected, not kept forever
dropped = weakref.ref(node)
del node
frozen = freeze_startup_heap()
assert dropped() is None
assert frozen == gc.get_freeze_count() > 10_000, frozen
assert gc.get_count()[0] < 50  # the young generation starts empty
print("ok", frozen)
"""


def test_freeze_startup_heap_freezes_what_start_up_left() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok")


TRIM = """
import sys
from kvpilot.server.gc_heap import release_free_heap
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 // 2**20
chunks = [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MiB of heap blocks (under malloc's mmap threshold)
for i in range(3000):
    chunks[i][::4096] = b"x" * len(range(0, 64 * 1024, 4096))  # touched
keep = chunks[-1]
del chunks  # freed, but below `keep` at the heap's top: glibc keeps the pages
before = rss_mib()
assert release_free_heap()
print("ok", before, rss_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim, /proc")
def test_the_freed_heap_goes_back_to_the_system() -> None:
    """What a model's load leaves freed in the C heap stays resident until malloc_trim (glibc)."""
    done = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    _, before, after = done.stdout.split()
    assert int(before) - int(after) > 100, done.stdout
