"""The rules across replicas (prefix-blind-routing, replica-imbalance): exact evidence when they fire, quiet
when routing kept prefixes together, with one replica, or with hits close to what the traffic offers; and the
per-replica headroom lines, also from a live probe phase through a double of the Ray app's contract."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape
from kvpilot.bench.tokens import WordTokenizer
from kvpilot.doctor.diagnose import DoctorReport, diagnose
from kvpilot.doctor.findings import Finding, Severity
from kvpilot.doctor.inputs import inputs_from_documents, load_inputs
from kvpilot.doctor.probe import Endpoint, run_phase
from kvpilot.doctor.probe_plan import ProbePhase
from kvpilot.doctor.thresholds import Thresholds
from tests.bench.replica_gateway import ReplicaGateway
from tests.doctor.builders import closed_loop, req, run, samples, write
from tests.doctor.scenarios import GATEWAY, prefix_blind_routing, replica_imbalance, replica_samples
from tests.server.tiny_server import MODEL, tiny_server, write_tiny_config

DATASET = DatasetConfig(kind="shared-prefix", input_len=640, prefix_len=512, num_prefixes=8, num_suffixes=4)


def _finding(report: DoctorReport, rule_id: str) -> Finding | None:
    return next((f for f in report.findings if f.rule_id == rule_id), None)


def _evidence(f: Finding) -> dict[str, float]:
    return {e.name: e.value for e in f.evidence}


def _shared_prefix_run(tmp: Path, *, hits_per_replica: float, replica_of, name: str = "r.json",
                       replicas: tuple[str, ...] = ("r0", "r1")) -> str:
    """32 requests of 8 prefix groups (4 each), closed loop 4; each replica's counters: 16 x 640 queries."""
    recs = closed_loop(32, 4, lambda i, t: req(i, t, prompt=640, prefill=60.0, group=f"prefix-{i % 8}",
                                                replica=replica_of(i)))
    share = 32 * 640.0 / len(replicas)
    counters = {rid: {"prefix_queries": share, "prefix_hits": hits_per_replica} for rid in replicas}
    gauges = {rid: {"running": 2, "waiting": 0} for rid in replicas}
    metrics = samples(6, running=4, waiting=0, kv=0.3, prefix_queries=32 * 640,
                      prefix_hits=hits_per_replica * len(replicas))
    return write(tmp / name, [run("concurrency=4", recs, metrics=metrics, replica_plan=GATEWAY,
                                  replica_samples=replica_samples(6, counters, gauges), prefix_share=0.8)],
                 dataset=DATASET)


def test_prefix_blind_routing_fires_with_the_numbers(tmp_path: Path) -> None:
    results, *_ = prefix_blind_routing(tmp_path)
    report = diagnose(load_inputs(results))
    assert report.findings[0].rule_id == "prefix-blind-routing"
    f = report.findings[0]
    assert f.severity is Severity.HIGH and f.confidence == 0.9  # 25% < half of the 60% offered
    ev = _evidence(f)
    assert ev["replicas"] == 2 and ev["replicas per prefix group (1 = affinity)"] == 2.0
    assert ev["reuse the traffic offers"] == pytest.approx(0.8 * 24 / 32)  # every group's first request misses
    assert ev["prefix-cache hit rate, all replicas"] == pytest.approx(0.25)
    assert ev["prefix-cache hit rate on r0"] == ev["prefix-cache hit rate on r1"] == pytest.approx(0.25)
    assert ev["imbalance (max / mean requests per replica)"] == 1.0
    assert f.impact == pytest.approx(0.35)
    assert "--routing prefix" in f.fixes[0].kvpilot and "--kv-events-config" in f.fixes[0].vllm
    miss = _finding(report, "prefix-cache-miss")  # the symptom defers to its cause
    assert miss is not None and miss.confidence == 0.4 and "prefix-blind-routing" in miss.summary
    assert any(line.startswith("2 replicas (http://gw:8000/metrics/replicas") and "2.00 replicas per prefix group"
               in line and "25% of 60% offered" in line for line in report.headroom)
    assert "  replica r0 (lane default): 16 requests, prefix hit rate 25% (2,560 of 10,240 tokens), waiting max 0" \
        in report.headroom


def test_medium_between_half_and_the_threshold_share(tmp_path: Path) -> None:
    """Hit rate 40% of a 60% offer (0.67 of it): medium; the same 0.4 with the threshold at 0.6: quiet."""
    path = _shared_prefix_run(tmp_path, hits_per_replica=0.4 * 16 * 640, replica_of=lambda i: f"r{(i // 8) % 2}")
    inputs = load_inputs([path])
    f = _finding(diagnose(inputs), "prefix-blind-routing")
    assert f is not None and f.severity is Severity.MEDIUM
    assert _finding(diagnose(inputs), "prefix-cache-miss") is None  # 40% is not under half of 60%
    relaxed = dataclasses.replace(Thresholds(), routing_hit_share_of_offered=0.6)
    assert _finding(diagnose(inputs, relaxed), "prefix-blind-routing") is None


def test_quiet_when_routing_keeps_each_prefix_on_one_replica(tmp_path: Path) -> None:
    """Groups 0-3 on r0, 4-7 on r1 (spread 1.0) with the same low hit rate: a cache problem, not routing."""
    path = _shared_prefix_run(tmp_path, hits_per_replica=2560.0, replica_of=lambda i: f"r{(i % 8) // 4}")
    report = diagnose(load_inputs([path]))
    assert _finding(report, "prefix-blind-routing") is None
    miss = _finding(report, "prefix-cache-miss")
    assert miss is not None and miss.confidence == 0.9  # no routing to blame: full confidence
    assert any("1.00 replicas per prefix group" in line for line in report.headroom)


def test_quiet_when_hits_come_close_to_the_offer(tmp_path: Path) -> None:
    """Blind routing with room for every prefix everywhere: 50% of 60% offered (0.83) is not worth a finding."""
    path = _shared_prefix_run(tmp_path, hits_per_replica=0.5 * 16 * 640, replica_of=lambda i: f"r{(i // 8) % 2}")
    assert _finding(diagnose(load_inputs([path])), "prefix-blind-routing") is None


def test_quiet_with_one_replica(tmp_path: Path) -> None:
    path = _shared_prefix_run(tmp_path, hits_per_replica=5120.0, replica_of=lambda i: "r0", replicas=("r0",))
    report = diagnose(load_inputs([path]))
    assert _finding(report, "prefix-blind-routing") is None and _finding(report, "replica-imbalance") is None
    assert _finding(report, "prefix-cache-miss") is not None


def test_spread_unknown_offer_known_fires_with_less_confidence(tmp_path: Path) -> None:
    """Replicas scraped by URL, responses without a replica header: only the offer and the hit rate to go on."""
    path = _shared_prefix_run(tmp_path, hits_per_replica=2560.0, replica_of=lambda i: None)
    f = _finding(diagnose(load_inputs([path])), "prefix-blind-routing")
    assert f is not None and f.confidence == 0.6
    assert "replicas per prefix group (1 = affinity)" not in _evidence(f)


def test_replica_imbalance(tmp_path: Path) -> None:
    results, *_ = replica_imbalance(tmp_path)
    report = diagnose(load_inputs(results))
    assert report.findings[0].rule_id == "replica-imbalance"
    f = report.findings[0]
    assert f.severity is Severity.MEDIUM and f.confidence == 0.8 and f.impact == pytest.approx(1 - 1 / 1.6)
    ev = _evidence(f)
    assert ev["imbalance (max / mean requests per replica of a lane)"] == pytest.approx(1.6)
    assert ev["requests served by r0"] == 32 and ev["requests served by r1"] == 8
    assert ev["requests waiting on r0, max"] == 2
    assert f.summary.startswith("r0 served 32 requests, 1.6x the mean")


def test_imbalance_is_quiet_when_even_or_thin(tmp_path: Path) -> None:
    even = closed_loop(40, 4, lambda i, t: req(i, t, replica=f"r{i % 2}"))
    path = write(tmp_path / "even.json", [run("c4", even, replica_plan=GATEWAY)])
    assert _finding(diagnose(load_inputs([path])), "replica-imbalance") is None
    thin = closed_loop(8, 4, lambda i, t: req(i, t, replica="r1" if i == 7 else "r0"))  # 7:1 but 4 per replica
    path = write(tmp_path / "thin.json", [run("c4", thin, replica_plan=GATEWAY)])
    assert _finding(diagnose(load_inputs([path])), "replica-imbalance") is None


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGateway]:
    config = write_tiny_config(tmp_path_factory.mktemp("tiny"))
    with tiny_server(config) as a, tiny_server(config) as b, ReplicaGateway([a.url, b.url]) as gw:
        yield gw


def test_live_probe_phase_reports_the_replicas(gateway: ReplicaGateway) -> None:
    """A probe phase (as `doctor --url` runs it) against an endpoint that answers /metrics/replicas: the
    diagnosis carries one headroom line per replica, with the requests each served."""
    phase = ProbePhase("shared-prefix", "prefix-cache-miss", DatasetConfig(
        kind="shared-prefix", input_len=64, output_len=2, num_prefixes=2, num_suffixes=4, prefix_len=48),
        LoadShape(concurrency=2, num_requests=8, duration_s=30))
    result = run_phase(Endpoint(gateway.url, MODEL, 256), phase, WordTokenizer(), timeout_s=30)
    assert result.num_ok == 8
    report = diagnose(inputs_from_documents([(result.result, "probe:shared-prefix")]))
    lines = [line for line in report.headroom if "replica" in line]
    assert lines[0].startswith(f"2 replicas ({gateway.url}/metrics/replicas, run ")
    assert lines[1].startswith("  replica replica-0 (lane interactive): 4 requests, prefix hit rate ")
    assert lines[2].startswith("  replica replica-1 (lane interactive): 4 requests, prefix hit rate ")
