"""The doctor's live probes measure the machine as a deployed server uses it: their servers (in this process or
started by `kvpilot doctor --serve`) run on every core, not on the one thread scripts/test.sh gives the suite's
other engines beside the second pytest worker."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="module")
def _live_probes_use_every_core(request: pytest.FixtureRequest) -> Iterator[None]:
    if not Path(str(request.node.path)).name.startswith("test_live_"):
        yield
        return
    from tests.conftest import torch_threads

    with pytest.MonkeyPatch.context() as patch, torch_threads(os.cpu_count() or 1):
        patch.delenv("OMP_NUM_THREADS", raising=False)
        yield
