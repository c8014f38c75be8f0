"""The measured load split over client processes (--client-processes): how a load is dealt, and a split run
against the scripted server (the same requests, measured as one client would)."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvpilot.bench.client import Target
from kvpilot.bench.client_processes import ProcessPlan, num_processes_for, split_items, split_shape
from kvpilot.bench.datasets import DatasetConfig, build_dataset
from kvpilot.bench.load import LoadShape
from kvpilot.bench.runner import run_load
from kvpilot.bench.tokens import WordTokenizer
from tests.doubles.scripted_process import ScriptedProcess
from tests.doubles.scripted_server import Behavior


def test_a_closed_loop_is_dealt_round_robin() -> None:
    shape = LoadShape(concurrency=5, num_requests=7, num_warmup=3, seed=10)
    shares = [split_shape(shape, 3, i) for i in range(3)]
    assert [s.concurrency for s in shares] == [2, 2, 1]
    assert [s.num_requests for s in shares] == [3, 2, 2]
    assert [s.seed for s in shares] == [10, 11, 12]  # each process its own arrivals and samples
    assert all(s.num_warmup == 0 for s in shares)  # the parent warms up


def test_an_open_loop_splits_its_rate_and_slots() -> None:
    shares = [split_shape(LoadShape(request_rate=30.0, max_concurrency=5, num_requests=9), 2, i) for i in range(2)]
    assert [s.request_rate for s in shares] == [15.0, 15.0]
    assert [s.max_concurrency for s in shares] == [3, 2]
    burst = split_shape(LoadShape(num_requests=9), 2, 0)
    assert math.isinf(burst.request_rate) and burst.num_requests == 5


def test_no_process_gets_an_empty_share() -> None:
    assert num_processes_for(LoadShape(concurrency=1, num_requests=50), 4) == 1  # a sweep's synchronous run
    assert num_processes_for(LoadShape(request_rate=5.0, num_requests=3), 8) == 3
    assert num_processes_for(LoadShape(concurrency=64, num_requests=512), 4) == 4
    with pytest.raises(ValueError, match="--client-processes 4 is more than"):
        split_shape(LoadShape(concurrency=2, num_requests=10), 4, 0)
    items = list(range(5))
    assert split_items(items, 2, 1) == [1, 3] and split_items(items[:1], 2, 1) == [0]  # type: ignore[arg-type]


def test_a_split_closed_loop_measures_every_request(scripted: ScriptedProcess) -> None:
    scripted.set_script(Behavior(ttft_s=0.03, itl_s=0.005, num_output_tokens=6))
    tok = WordTokenizer()
    items = build_dataset(DatasetConfig(input_len=16, output_len=6), tok, 12)
    target = Target(scripted.base_url, scripted.model, "completions", stream=True, timeout_s=20.0)
    seen = []
    before = len(scripted.served())
    out = asyncio.run(run_load(target, items, LoadShape(concurrency=4, num_requests=24, num_warmup=2), tok,
                               on_record=seen.append, processes=ProcessPlan(2)))
    assert len(out.records) == len(seen) == 24 and all(r.ok for r in out.records)
    assert len(scripted.served()) - before == 26  # 2 warmup requests from the parent, 24 measured
    assert [r.request_index for r in out.records] == list(range(24))  # renumbered in the order sent
    assert [r.sent_s for r in out.records] == sorted(r.sent_s for r in out.records)
    assert all(r.num_output_tokens == 6 and r.num_chunks == 6 and len(r.itl_ms) == 5 for r in out.records)
    assert all(r.ttft_ms is not None and r.ttft_ms >= 30.0 - 1.0 for r in out.records)
    # Both processes' streams were in flight together: 4 at once at some point, never more.
    spans = [(r.sent_s, r.sent_s + r.e2e_ms / 1000) for r in out.records]
    most = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert most == 4
    assert out.loop_lag_ms and out.wall_s > 0  # the client processes' own event-loop lag


def test_bench_sweeps_with_client_processes(scripted: ScriptedProcess, tmp_path) -> None:
    """Through run_bench (what `kvpilot bench --client-processes 2 --sweep` runs): the synchronous run stays in
    one process, the others split; every run's requests are all measured and written."""
    import json

    from rich.console import Console

    from kvpilot.bench.api import BenchConfig, run_bench

    scripted.set_script(Behavior(ttft_s=0.02, itl_s=0.004, num_output_tokens=5))
    cfg = BenchConfig(target=Target(scripted.base_url, "", timeout_s=20.0),
                      dataset=DatasetConfig(input_len=12, output_len=5), load=LoadShape(num_requests=10),
                      sweep=True, sweep_num_points=2, metrics_url="", json_path=str(tmp_path / "r.json"),
                      progress=False, client_processes=2)
    outcome = run_bench(cfg, Console(record=True, width=140))
    assert [r.label for r in outcome.runs][0] == "synchronous"
    assert all(r.aggregates.num_ok == 10 and r.aggregates.num_errors == 0 for r in outcome.runs)
    written = json.loads((tmp_path / "r.json").read_text())
    assert [run["client_processes"] for run in written["runs"]] == [1, 2]  # synchronous: one stream, one process
    for run in written["runs"]:
        assert sorted(rec["request_index"] for rec in run["requests"]) == list(range(10))
