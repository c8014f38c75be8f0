"""The fault matrix's long-prompts cell on the real kvpilot server: another client's long prompts, prefilled whole
in one step (a 4,096-token budget), beside a bench of short chats that never sees them. The doctor reads them from
the server's /metrics (two scrapes around the bench) and names "Long prompts stall decodes" with the chunk cap
and disaggregation as fixes."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape
from kvpilot.doctor.prometheus import metrics_delta, parse_prometheus_text
from tests.doctor.bench_worker import BenchWorker
from tests.doctor.fault_staging import background_load
from tests.doctor.live_staging import bench, doctor, kvpilot_server, ranked

pytestmark = pytest.mark.slow

CHATS = DatasetConfig(kind="random", input_len=32, output_len=4, seed=3)


@pytest.fixture(scope="module")
def worker() -> Iterator[BenchWorker]:
    with BenchWorker() as w:
        yield w


def test_other_clients_long_prompts_stall_the_measured_decodes(llm_fp32, worker: BenchWorker) -> None:
    with kvpilot_server(llm_fp32.loaded, kv_cache_memory="512MiB", max_model_len=4096,
                        max_num_batched_tokens=4096) as server:
        before = parse_prometheus_text(httpx.get(f"{server.url}/metrics").text)
        stop = threading.Event()
        other = threading.Thread(target=background_load, args=(server.url, 1, 1100, 1, 0.1, stop), daemon=True)
        other.start()
        try:
            measured = bench(worker, server.url, CHATS, LoadShape(concurrency=4, num_requests=8), "chats")
        finally:
            stop.set()
            other.join(30)
        after = parse_prometheus_text(httpx.get(f"{server.url}/metrics").text)
    report = doctor(measured, metrics=metrics_delta(before, after))
    found = [f for f in report.findings if f.title == "Long prompts stall decodes"]
    assert found, ranked(report)
    names = {e.name: e.value for e in found[0].evidence}
    assert names["prompts longer than any measured request's"] >= 3 and names["steps over 1000 tokens"] >= 3
    assert found[0].fixes[0].kvpilot == "--max-num-batched-tokens 512" and "--kv-role" in found[0].fixes[1].kvpilot
    ids = [f.rule_id for f in report.findings]
    assert "degraded-run" not in ids or ids.index("degraded-run") > ids.index("prefill-interrupts-decode")
