"""release_omp_pool frees the calling thread's OpenMP workers and nothing else: with torch loaded it finds
the process's libgomp and succeeds, and the kernels' next parallel regions (on this thread and on another)
still run on all of torch's threads."""

from __future__ import annotations

import threading

import pytest
import torch

from kvpilot.model.layers.cpu_decode_kernel import get_kernel
from kvpilot.omp_pool import release_omp_pool

pytestmark = pytest.mark.skipif(get_kernel() is None, reason="no C++ toolchain: no OpenMP kernels")


def test_release_keeps_every_thread_working() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert get_kernel().parallel_width() == 2  # this thread now owns a pool
        assert release_omp_pool() is True
        widths: list[int] = []
        worker = threading.Thread(target=lambda: widths.append(get_kernel().parallel_width()))
        worker.start()
        worker.join()
        assert widths == [2]
        assert get_kernel().parallel_width() == 2  # a new pool on this thread
    finally:
        torch.set_num_threads(before)


def test_an_engine_core_thread_hands_its_workers_back_whenever_it_goes_idle(llm_fp32, monkeypatch) -> None:
    """An engine core in a thread (tests, Ray replicas) must not keep an idle pool beside other threads' pools:
    libgomp then throttles every thread's regions to wake-ups (the module docstring of omp_pool.py)."""
    import time

    import httpx

    from kvpilot.server import ServerArgs, create_app, engine_factory
    from kvpilot.server.background import BackgroundServer
    from kvpilot.server.core import step_loop
    from tests.server.conftest import server_engine_args

    calls: list[str] = []
    real = step_loop.release_omp_pool
    monkeypatch.setattr(step_loop, "release_omp_pool",
                        lambda: calls.append(threading.current_thread().name) or real())
    app = create_app(engine_factory(server_engine_args(), loaded=llm_fp32.loaded, warmup=False),
                     ServerArgs(served_model_names=("m",), engine_process=False))
    with BackgroundServer(app) as server:
        idle_at_start = len(calls)
        answer = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3},
                            timeout=60)
        deadline = time.monotonic() + 10
        while len(calls) == idle_at_start and time.monotonic() < deadline:
            time.sleep(0.01)
    assert answer.status_code == 200
    assert len(calls) > idle_at_start and threading.main_thread().name not in calls


@pytest.mark.parametrize(("setup", "env", "expected"), [
    ("import kvpilot", {}, "3000"),  # kvpilot first: libgomp will spin briefly
    ("import kvpilot", {"OMP_WAIT_POLICY": "active"}, None),  # the user's setting stands
    ("import kvpilot", {"GOMP_SPINCOUNT": "50"}, "50"),
    ("import torch, kvpilot", {}, None),  # libgomp already loaded: nothing changed for children to inherit
])
def test_importing_kvpilot_sets_a_short_spin_unless_the_user_or_torch_came_first(setup: str, env: dict[str, str],
                                                                                 expected: str | None) -> None:
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    proc = subprocess.run([sys.executable, "-c", f"{setup}; import os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                          env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(expected)
