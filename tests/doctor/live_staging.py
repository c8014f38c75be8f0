"""Honest faults for the doctor's live scenarios on the real kvpilot server (tests only).

Each helper changes what a real deployment could get wrong, never the engine's own code path: the
server's settings (engine args, server args) and a slow tokenizer installed into the running server. The
faults staged around a server (a delaying TCP proxy, busy processes, a busy client, other traffic) are in
fault_staging.py, shared with benchmarks/doctor_matrix.py. The real engine computes every token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from kvpilot.bench.api import BenchConfig
from kvpilot.bench.client import Target
from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape
from kvpilot.doctor.diagnose import DoctorReport, diagnose
from kvpilot.doctor.inputs import inputs_from_documents
from kvpilot.launch.args import EngineArgs
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from tests.doctor.bench_worker import BenchWorker

MODEL = "smollm2-doctor"
T = TypeVar("T")


def engine_args(**overrides: Any) -> EngineArgs:
    """A small, healthy configuration; scenarios override one setting to stage their fault. The KV pool holds
    4.3 requests of max_model_len (float32, 720 KiB a block of 16 tokens): bench stores the capacity endpoint
    with its result, and a pool below 4 would be a fault of its own (kv-pool-too-small)."""
    settings: dict[str, Any] = dict(dtype="float32", kv_cache_memory="192MiB", max_model_len=1024)
    settings.update(overrides)
    return EngineArgs(**settings)


@contextlib.contextmanager
def kvpilot_server(loaded: Any, api_key: str | None = None, **overrides: Any) -> Iterator[BackgroundServer]:
    """A real kvpilot server on the session's weights (``llm_fp32.loaded``), one engine of its own; ``api_key``:
    the key it requires (None: none)."""
    app = create_app(engine_factory(engine_args(**overrides), loaded, warmup=True),
                     ServerArgs(served_model_names=(MODEL,), stats_interval=60.0, engine_process=False,
                                api_key=api_key))
    with BackgroundServer(app) as server:
        yield server


class SlowTokenizer:
    """The server's own tokenizer, slowed: every ``encode`` sleeps ``delay_s`` first, like a pure
    Python tokenizer or preprocessing hook on the server's event loop. Everything else delegates."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        time.sleep(self.delay_s)
        return self.inner.encode(*args, **kwargs)

    def encode_chat(self, *args: Any, **kwargs: Any) -> list[int]:
        time.sleep(self.delay_s)
        return self.inner.encode_chat(*args, **kwargs)

    @property
    def backend(self) -> None:
        """No fast `tokenizers` backend: the server then calls `encode`, the slowed path."""
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def slow_tokenizer(server: BackgroundServer, delay_s: float) -> Iterator[None]:
    """Install a :class:`SlowTokenizer` as the running server's tokenizer (the HTTP side tokenizes with the
    one the engine core sent at start); restored on exit."""
    client = server.state.client
    original = client.tokenizer
    client.tokenizer = SlowTokenizer(original, delay_s)
    try:
        yield
    finally:
        client.tokenizer = original


@dataclass(frozen=True)
class Measured:
    """One bench run against a live server: its result document."""

    result: dict[str, Any]
    label: str


def bench(worker: BenchWorker, url: str, dataset: DatasetConfig, load: LoadShape, label: str = "bench",
          slos: dict[str, float] | None = None, busy_client: bool = False) -> Measured:
    """``run_bench`` in the worker process: streaming, exact output lengths, /metrics scraped often."""
    cfg = BenchConfig(Target(url, MODEL, ignore_eos=True, timeout_s=120.0), dataset=dataset, load=load,
                      slos=slos or {}, scrape_interval_s=0.1, progress=False)
    return Measured(worker.run(cfg, busy_client), label)


def doctor(*runs: Measured, slos_ms: dict[str, float] | None = None, **kwargs: Any) -> DoctorReport:
    """Diagnose the runs together (``kwargs``: model, gpu for the roofline; ``slos_ms`` as --slo gives)."""
    inputs = inputs_from_documents([(m.result, m.label) for m in runs], **kwargs)
    return diagnose(dataclasses.replace(inputs, slos_ms=dict(slos_ms or {})))


def ranked(report: DoctorReport) -> list[tuple[str, str]]:
    """(rule_id, severity) in rank order: the assertion message of every scenario."""
    return [(f.rule_id, f.severity.value) for f in report.findings]


def measured_until(measure: Callable[[], tuple[T, str | None]], what: str, tries: int = 2) -> T:
    """The first of at most ``tries`` measurements that shows ``what``: ``measure`` returns its value and None,
    or what it saw instead (the test fails with every one of those).

    Why a second measurement: the suite's other worker shares this 2-core box, and a burst of its work during
    one of a scenario's runs (the lone stream, say) moves a ratio the rule judges across its bar. Two such
    bursts in both measurements are rarer; a rule that misses the staged cause misses it twice."""
    seen = []
    for _ in range(tries):
        value, miss = measure()
        if miss is None:
            return value
        seen.append(miss)
    pytest.fail(f"{what}: not seen in {tries} measurements: {seen}")
