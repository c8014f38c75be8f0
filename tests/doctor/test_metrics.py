"""Prometheus text with vLLM's names (V1 and V0) and kvpilot's own server drives the same rules."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvpilot.bench.datasets import DatasetConfig
from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.errors import DoctorInputError
from kvpilot.doctor.inputs import DoctorInputs, load_inputs
from kvpilot.doctor.prometheus import MetricsSnapshot, metrics_delta, parse_prometheus_text
from tests.doctor.builders import closed_loop, jitter, req, run, write

FIX = Path(__file__).parent / "fixtures"


def _snap(name: str) -> MetricsSnapshot:
    return parse_prometheus_text((FIX / name).read_text())


def test_v1_names_parse_newest_first() -> None:
    s = _snap("vllm_v1_after.txt")
    assert s.get("kv_usage") == pytest.approx(0.41)
    assert s.names["kv_usage"] == "vllm:kv_cache_usage_perc"
    assert s.get("prefix_queries") == 26600 and s.get("prefix_hits") == 1536
    assert s.get("preemptions") == 0  # the *_created timestamps are not added in
    assert s.get("num_finished") == 42  # summed over finished_reason label sets
    assert s.histograms["ttft"].count == 42 and s.mean_ms("ttft") == pytest.approx(60, rel=0.3)
    assert s.prefix_caching_enabled is True and s.flavor == "vllm-v1"


def test_v0_names_parse() -> None:
    s = _snap("vllm_v0_swapping.txt")
    assert s.flavor == "vllm-v0" and s.get("kv_usage") == pytest.approx(0.74)
    assert s.get("swapped") == 2 and s.get("cpu_kv_usage") == pytest.approx(0.18)
    assert s.names["itl"] == "vllm:time_per_output_token_seconds" and s.mean_ms("itl") == pytest.approx(60)
    assert s.swap_used_bytes == pytest.approx(8589934592 - 3221225472)
    assert s.prefix_caching_enabled is False


def test_delta_of_two_scrapes() -> None:
    d = metrics_delta(_snap("vllm_v1_before.txt"), _snap("vllm_v1_after.txt"))
    assert d.get("prefix_queries") == 40 * 640 and d.get("prefix_hits") == 1536
    assert d.histograms["ttft"].count == 40
    assert d.get("kv_usage") == pytest.approx(0.41)  # a gauge: the later value


def test_not_prometheus_text_is_unusable_input() -> None:
    with pytest.raises(DoctorInputError, match="no series the doctor knows"):
        parse_prometheus_text("# just a comment\nfoo_bar 1\n")
    with pytest.raises(DoctorInputError, match="Prometheus"):
        parse_prometheus_text("{not: prometheus}\n")


def test_vllm_metrics_alone_name_kv_pressure() -> None:
    report = diagnose(load_inputs([], [str(FIX / "vllm_v1_pressure.txt")]))
    assert report.findings[0].rule_id == "kv-cache-pressure"
    evidence = {e.name: e.value for e in report.findings[0].evidence}
    assert evidence["KV-cache usage, peak"] == pytest.approx(0.98) and evidence["preemptions"] == 57
    # the metrics file's own histogram means give a latency split
    assert report.splits[-1].source == "metrics means" and report.splits[-1].queue_ms == pytest.approx(1900, rel=0.3)


def test_vllm_bench_result_and_metrics_name_prefix_misses(tmp_path: Path) -> None:
    """vLLM gives no per-request stage timings: the hit rate comes from its counters (after - before)."""
    rng = random.Random(0)
    recs = closed_loop(40, 4, lambda i, t: req(i, t, server=False, prompt=640, prefill=jitter(rng, 60),
                                                group=f"prefix-{i % 4}"))
    dataset = DatasetConfig(kind="shared-prefix", input_len=640, prefix_len=512, num_prefixes=4, num_suffixes=10)
    path = write(tmp_path / "vllm.json", [run("concurrency=4", recs)], dataset=dataset)
    report = diagnose(load_inputs([path], [str(FIX / "vllm_v1_before.txt"), str(FIX / "vllm_v1_after.txt")]))
    top = report.findings[0]
    assert top.rule_id == "prefix-cache-miss"
    hit = next(e for e in top.evidence if e.name == "measured prefix-cache hit rate")
    assert hit.value == pytest.approx(1536 / 25600) and "metrics file" in hit.source


def test_kvpilot_server_metrics_name_tokenization() -> None:
    """kvpilot's own /metrics (rendered by its server code) carries kvpilot:tokenization_time_seconds."""
    from kvpilot.engine.scheduler_stats import SchedulerStats
    from kvpilot.engine.timeline import RequestMetrics
    from kvpilot.server.observe.metrics import ServerMetrics

    stats = SchedulerStats(2, 0, 0.2, 1000, 0, 0, 100, 0, 20, 120)
    metrics = ServerMetrics("smollm2", lambda: stats)
    for i in range(20):
        metrics.observe_tokenization(0.12)
        metrics.observe_finished(RequestMetrics(f"r{i}", 900, 32, 0, 0, "length", 0.12, 0.001, 0.05, 0.171,
                                                0.4, 0.58, tuple([0.0125] * 31)))
    snap = parse_prometheus_text(metrics.render().decode())
    assert snap.get("running") == 2 and snap.mean_ms("tokenize") == pytest.approx(120)
    report = diagnose(DoctorInputs(metrics=snap))
    assert report.findings[0].rule_id == "tokenization"


def test_vllm_client_only_result_uses_metrics_means_for_the_queue(tmp_path: Path) -> None:
    """Without kvpilot's per-request timings the queue share comes from vLLM's histogram means."""
    rng = random.Random(1)
    recs = closed_loop(30, 16, lambda i, t: req(i, t, server=False, prefill=jitter(rng, 2400)))
    path = write(tmp_path / "vllm.json", [run("concurrency=16", recs, concurrency=16)])
    report = diagnose(load_inputs([path], [str(FIX / "vllm_v1_pressure.txt")]))
    ranked = [f.rule_id for f in report.findings]
    assert ranked[0] == "kv-cache-pressure" and "queueing" in ranked
    queueing = next(f for f in report.findings if f.rule_id == "queueing")
    share = next(e for e in queueing.evidence if e.name == "queue share of server TTFT")
    assert share.source == "metrics means" and 0.6 < share.value < 0.95


def test_kvpilot_rejections_count_as_queueing() -> None:
    """Requests refused by kvpilot's admission caps (--max-num-queued-reqs) show in its own counter."""
    from kvpilot.engine.scheduler_stats import SchedulerStats
    from kvpilot.server.observe.metrics import ServerMetrics

    metrics = ServerMetrics("smollm2", lambda: SchedulerStats(8, 64, 0.5, 0, 0, 0, 60, 0, 60, 120))
    for _ in range(30):
        metrics.reject("queue_full")
    metrics.request_success.labels("smollm2", "length").inc(20)
    snap = parse_prometheus_text(metrics.render().decode())
    assert snap.get("rejected") == 30 and snap.get("num_finished") == 20
    top = diagnose(DoctorInputs(metrics=snap)).findings[0]
    assert top.rule_id == "queueing" and any(f.kvpilot.startswith("--max-num-queued-reqs") for f in top.fixes)
