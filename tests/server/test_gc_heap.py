"""freeze_startup_heap (server processes only): in a fresh interpreter, since frozen objects are never
collected and the test process builds and drops many engines."""

from __future__ import annotations

import subprocess
import sys

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
