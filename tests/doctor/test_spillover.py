"""memory-spillover on kvpilot's own memory series (/proc gauges rendered by the server's metrics code):
the server's pages in swap and read back while it generates are the strongest evidence, cold pages in
swap are a note, host swap alone is weaker, and decode-bound defers to a swapping server."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvpilot.bench.scrape import MetricsSample, known_samples, parse_metrics, summarize
from kvpilot.doctor.diagnose import DoctorReport, diagnose
from kvpilot.doctor.findings import Finding, Severity
from kvpilot.doctor.inputs import load_inputs
from kvpilot.engine.engine import StepStats
from kvpilot.engine.scheduler_stats import SchedulerStats
from kvpilot.engine.timeline import RequestMetrics
from kvpilot.server.observe.metrics import MemoryCollector, ServerMetrics
from kvpilot.server.observe.proc_memory import HostSwap, ProcessMemory
from tests.doctor.builders import closed_loop, jitter, req, run, write
from tests.doctor.scenarios import SCENARIOS

MIB = 2**20


class _Memory:
    """What /proc says at each scrape: the test moves it between scrapes like the kernel would."""

    def __init__(self, rss: int, swap: int, faults: int, host: HostSwap | None) -> None:
        self.process = ProcessMemory(rss, swap, faults)
        self.host = host


def _server(memory: _Memory) -> ServerMetrics:
    return ServerMetrics("smollm2", lambda: SchedulerStats(1, 0, 0.1, 0, 0, 0, 100, 0, 10, 110),
                         MemoryCollector(lambda: memory.process, lambda: memory.host))


def _generate(metrics: ServerMetrics, num_requests: int, tokens: int = 32) -> None:
    """The token counters move per engine step (one prefill, then decodes), the histograms at the finish."""
    for i in range(num_requests):
        metrics.observe_prefill_done(64)
        metrics.observe_step(StepStats(64, 64, 0, 1, 0, 1, 0.2))
        for _ in range(tokens - 1):
            metrics.observe_step(StepStats(1, 0, 1, 1, 0, 1, 0.1))
        metrics.observe_finished(RequestMetrics(f"r{i}", 64, tokens, 0, 0, "length", 0.01, 0.001, 0.2, 0.21,
                                                3.0, 3.2, tuple([0.1] * (tokens - 1))))


def _scrapes(tmp_path: Path, *, swap_mib: int, faults_during: int, rss_mib: int = 700,
             host: HostSwap | None = HostSwap(2048 * MIB, 1700 * MIB)) -> list[str]:
    """/metrics before and after 10 requests of 32 tokens, as two files (kvpilot doctor --metrics-file x2)."""
    memory = _Memory(rss_mib * MIB, swap_mib * MIB, 2000, host)
    server = _server(memory)
    before = tmp_path / "before.txt"
    before.write_text(server.render().decode())
    _generate(server, 10)
    memory.process = ProcessMemory(rss_mib * MIB, swap_mib * MIB, 2000 + faults_during)
    after = tmp_path / "after.txt"
    after.write_text(server.render().decode())
    return [str(before), str(after)]


def _spill(report: DoctorReport) -> Finding:
    return next(f for f in report.findings if f.rule_id == "memory-spillover")


def _evidence(finding: Finding) -> dict[str, float]:
    return {e.name: e.value for e in finding.evidence}


def test_server_pages_read_back_from_swap_are_the_bottleneck(tmp_path: Path) -> None:
    """300 MiB of a 1 GiB server in swap, 8000 major faults over 320 generated tokens."""
    report = diagnose(load_inputs([], _scrapes(tmp_path, swap_mib=300, faults_during=8000)))
    top = report.findings[0]
    assert top.rule_id == "memory-spillover" and top.severity is Severity.HIGH and top.confidence == 0.9
    evidence = _evidence(top)
    assert evidence["server process memory in swap"] == pytest.approx(300 / 1024)
    assert evidence["share of the server process's memory in swap"] == pytest.approx(300 / 1000)
    assert evidence["major page faults per generated token"] == pytest.approx(8000 / 320)
    assert "waited for the disk 25.0 times per generated token" in top.summary
    assert top.fixes[0].kvpilot.startswith("--kv-cache-memory")


def test_cold_pages_in_swap_are_a_low_note(tmp_path: Path) -> None:
    """The same swap, but nothing was read back while the server generated: not the bottleneck now."""
    report = diagnose(load_inputs([], _scrapes(tmp_path, swap_mib=300, faults_during=3)))
    spill = _spill(report)
    assert spill.severity is Severity.LOW and "cold pages" in spill.summary
    assert report.healthy


def test_one_scrape_cannot_tell_hot_from_cold(tmp_path: Path) -> None:
    """Lifetime fault counts include loading the model: one scrape says 'in swap', not 'on the hot path'."""
    spill = _spill(diagnose(load_inputs([], _scrapes(tmp_path, swap_mib=300, faults_during=8000)[1:])))
    assert spill.severity is Severity.MEDIUM and spill.confidence == 0.6
    assert "major page faults per generated token" not in _evidence(spill)


def test_a_few_cold_pages_are_housekeeping(tmp_path: Path) -> None:
    """20 MiB of 720 swapped (under 5%): no finding about the server; the host's swap is someone else's."""
    spill = _spill(diagnose(load_inputs([], _scrapes(tmp_path, swap_mib=20, faults_during=0))))
    assert spill.severity is Severity.LOW and "other processes" in spill.summary


def test_no_swap_anywhere_is_no_finding(tmp_path: Path) -> None:
    report = diagnose(load_inputs([], _scrapes(tmp_path, swap_mib=0, faults_during=0, host=HostSwap(0, 0))))
    assert "memory-spillover" not in [f.rule_id for f in report.findings]


def test_host_swap_without_process_figures_is_weaker(tmp_path: Path) -> None:
    """node_exporter's lines only (e.g. next to a vLLM server): the swap may be another process's."""
    path = tmp_path / "node.txt"
    path.write_text("vllm:num_requests_running 1\nnode_memory_SwapTotal_bytes 8589934592\n"
                    "node_memory_SwapFree_bytes 4294967296\n")
    spill = _spill(diagnose(load_inputs([], [str(path)])))
    assert spill.severity is Severity.MEDIUM and spill.confidence == 0.4
    assert _evidence(spill)["host swap in use"] == pytest.approx(4.0)


def _bench_samples(swap_mib: float, faults: tuple[float, float]) -> list[MetricsSample]:
    """The bench's scrapes of a 1 GiB server with ``swap_mib`` in swap, major faults before/after."""
    mem = {"process_resident": (1024 - swap_mib) * MIB, "process_swap": swap_mib * MIB,
           "swap_total_bytes": 2048.0 * MIB, "swap_free_bytes": (2048 - swap_mib) * MIB}
    during = {"running": 1.0, "waiting": 0.0, "kv_usage": 0.05, **mem}
    return [MetricsSample(0.0, "before", {**during, "running": 0.0, "major_faults": faults[0]}),
            MetricsSample(2.0, "during", {**during, "major_faults": (faults[0] + faults[1]) / 2}),
            MetricsSample(4.0, "after", {**during, "running": 0.0, "major_faults": faults[1]})]


def test_decode_bound_defers_to_a_swapping_server(tmp_path: Path) -> None:
    """Batch-1 decode at 400 ms/token (the roofline floor for smollm2-135m on this CPU is ~11 ms) while
    the bench's scrapes show the server reading swapped pages back: decode is slow *because* of swap."""
    rng = random.Random(21)
    recs = closed_loop(6, 1, lambda i, t: req(i, t, prompt=64, prefill=jitter(rng, 900),
                                              itl=[jitter(rng, 400, 0.1) for _ in range(15)]))
    path = write(tmp_path / "r.json", [run("concurrency=1", recs, concurrency=1,
                                           metrics=_bench_samples(400, (2000.0, 2000.0 + 40 * 96)))])
    report = diagnose(load_inputs([path], model="smollm2-135m", gpu="cpu"))
    ids = [f.rule_id for f in report.findings]
    assert ids[0] == "memory-spillover", ids
    decode = next(f for f in report.findings if f.rule_id == "decode-bound")
    assert decode.confidence < report.findings[0].confidence and "see memory-spillover" in decode.summary
    assert _evidence(report.findings[0])["major page faults per generated token"] == pytest.approx(40)


def test_decode_bound_stays_first_without_swap(tmp_path: Path) -> None:
    rng = random.Random(22)
    recs = closed_loop(6, 1, lambda i, t: req(i, t, prompt=64, itl=[jitter(rng, 400, 0.1) for _ in range(15)]))
    path = write(tmp_path / "r.json", [run("concurrency=1", recs, concurrency=1,
                                           metrics=_bench_samples(0, (2000.0, 2000.0)))])
    report = diagnose(load_inputs([path], model="smollm2-135m", gpu="cpu"))
    assert report.findings[0].rule_id == "decode-bound" and report.findings[0].confidence >= 0.7
    assert "memory-spillover" not in [f.rule_id for f in report.findings]


def test_step_time_rules_defer_to_a_swapping_server(tmp_path: Path) -> None:
    """Long prefills stalling others' decode (the staged prefill-interrupts-decode input) on a server
    that also reads swapped pages back on every step: the swap inflates every step, so it ranks first
    and the stall finding says so, with lower confidence. Measured live: a thrashing server's long
    prefills thrash hardest, and prefill-interrupts-decode (high, 0.74) outranked the swap."""
    results, _, _, _ = SCENARIOS["prefill-interrupts-decode"](tmp_path)
    report = diagnose(load_inputs(results, _scrapes(tmp_path, swap_mib=300, faults_during=8000)))
    ids = [f.rule_id for f in report.findings]
    assert ids[0] == "memory-spillover", ids
    stalls = next(f for f in report.findings if f.rule_id == "prefill-interrupts-decode")
    assert stalls.confidence == 0.4 and "see memory-spillover" in stalls.summary
    cold = diagnose(load_inputs(results, _scrapes(tmp_path, swap_mib=300, faults_during=0)))
    assert cold.findings[0].rule_id == "prefill-interrupts-decode"  # cold pages in swap explain nothing


def test_bench_scrape_keeps_the_memory_series() -> None:
    """The bench parses only the series it reads; the doctor's spill evidence must survive that filter."""
    server = _server(_Memory(600 * MIB, 400 * MIB, 2000, HostSwap(2048 * MIB, 1648 * MIB)))
    text = server.render().decode()
    values = parse_metrics(text)
    assert values["process_swap"] == 400 * MIB and values["process_resident"] == 600 * MIB
    assert values["major_faults"] == 2000 and values["swap_total_bytes"] - values["swap_free_bytes"] == 400 * MIB
    assert all(not line.startswith("#") for line in known_samples(text).splitlines())
    summary = summarize(_bench_samples(400, (2000.0, 5000.0)))
    assert summary.process_swap_max == 400 * MIB and summary.process_swap_share_max == pytest.approx(400 / 1024)
    assert summary.major_faults == 3000 and summary.host_swap_used_max == 400 * MIB
