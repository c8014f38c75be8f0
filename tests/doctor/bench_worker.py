"""``run_bench`` in a process of its own, for the live scenarios (tests only).

The scenarios' kvpilot servers run inside the test process (they share the session's weights). A
load generator in that process would share its GIL with the server's event loop and engine thread,
and its event-loop lag (the doctor's ``client-overload`` evidence) would measure the server's Python
work. A real load generator runs elsewhere; so does this one. Only ``kvpilot.bench`` is imported in
the worker (no torch), and prompts use the bench's word tokenizer: SmolLM2 encodes its common-word
list one token per word, and the server reports exact counts in ``usage`` anyway.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from kvpilot.bench.api import BenchConfig
from tests.doctor.fault_staging import gil_hog


def bench_result(cfg: BenchConfig, busy_client: bool = False) -> dict[str, Any]:
    """Runs in the worker: the bench result document (schema_version 1), summary not printed.

    ``busy_client`` stages a load generator that shares its process with CPU-bound Python work
    (fault_staging.gil_hog: a thread spinning for the whole run, a 30 ms GIL switch interval): the bench's
    event loop then runs late, which is what its lag detector must catch."""
    from rich.console import Console  # noqa: PLC0415

    from kvpilot.bench.api import run_bench  # noqa: PLC0415

    with gil_hog(0.03) if busy_client else contextlib.nullcontext():
        return run_bench(cfg, Console(file=io.StringIO())).result


class BenchWorker:
    """One spawned worker process; ``run`` blocks until the bench is done. Use as a context manager."""

    def __init__(self) -> None:
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))

    def run(self, cfg: BenchConfig, busy_client: bool = False, timeout_s: float = 300.0) -> dict[str, Any]:
        return self._pool.submit(bench_result, cfg, busy_client).result(timeout=timeout_s)

    def __enter__(self) -> BenchWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
