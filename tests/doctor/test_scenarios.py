"""Each rule fires on the staged fault that causes it, and the doctor names that cause first."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpilot.doctor.diagnose import DoctorReport, diagnose
from kvpilot.doctor.findings import Severity
from kvpilot.doctor.inputs import load_inputs
from kvpilot.doctor.rules import RECOMMENDATIONS, RULES
from tests.doctor.host_scenarios import HOST_SCENARIOS
from tests.doctor.scenarios import SCENARIOS, Scenario, healthy


def _report(tmp_path: Path, scenario: Callable[[Path], Scenario]) -> DoctorReport:
    results, metrics, model, gpu = scenario(tmp_path)
    return diagnose(load_inputs(results, metrics, model, gpu))


@pytest.mark.parametrize("rule_id", sorted(SCENARIOS))
def test_scenario_names_its_cause_first(tmp_path: Path, rule_id: str) -> None:
    report = _report(tmp_path, SCENARIOS[rule_id])
    ranked = [f.rule_id for f in report.findings]
    assert ranked and ranked[0] == rule_id, f"expected {rule_id} first, got {ranked}"
    top = report.findings[0]
    assert top.severity in (Severity.HIGH, Severity.MEDIUM)
    assert top.evidence and all(e.name for e in top.evidence)
    assert top.fixes and 0.5 <= top.confidence <= 1.0
    assert report.exit_code == 1 and not report.healthy


def test_every_rule_has_a_scenario() -> None:
    """Saved-file scenarios here; the configuration and host rules' in host_scenarios.py; the workload
    recommendation (not a fault) in test_slo_workload.py."""
    assert len(SCENARIOS) + len(HOST_SCENARIOS) == len(RULES) - len(RECOMMENDATIONS)


def test_healthy_run_has_nothing_above_low(tmp_path: Path) -> None:
    report = _report(tmp_path, healthy)
    assert all(f.severity is Severity.LOW for f in report.findings), [f.rule_id for f in report.findings]
    assert report.healthy and report.exit_code == 0
    assert any("KV cache peaked at 30%" in line for line in report.headroom)


def test_kv_pressure_ranks_above_the_queue_it_causes(tmp_path: Path) -> None:
    """A full KV cache also makes requests wait; the queueing finding must defer to it."""
    ranked = [f.rule_id for f in _report(tmp_path, SCENARIOS["kv-cache-pressure"]).findings]
    assert "queueing" in ranked and ranked.index("kv-cache-pressure") < ranked.index("queueing")


def test_filling_kv_cache_is_a_low_note_and_still_healthy(tmp_path: Path) -> None:
    results, _, _, _ = healthy(tmp_path)
    doc = json.loads(Path(results[0]).read_text())
    for sample in doc["runs"][0]["server_metrics"]["samples"]:
        sample["values"]["kv_usage"] = 0.8 if sample["phase"] == "during" else 0.0
    doc["runs"][0]["server_metrics"]["summary"]["kv_usage_max"] = 0.8
    Path(results[0]).write_text(json.dumps(doc))
    report = diagnose(load_inputs(results))
    assert [(f.rule_id, f.severity) for f in report.findings] == [("kv-cache-pressure", Severity.LOW)]
    assert report.healthy and report.exit_code == 0 and "low-severity" in report.verdict


def test_healthy_headroom_against_the_roofline(tmp_path: Path) -> None:
    report = diagnose(load_inputs(healthy(tmp_path)[0], model="llama-3.1-8b", gpu="h100-sxm"))
    assert report.healthy
    assert any(line.startswith("decode at 37% of the roofline TPOT floor") for line in report.headroom), report.headroom


def test_prefill_at_the_hardwares_speed_is_a_note_unless_a_ttft_slo_is_missed(tmp_path: Path) -> None:
    """The staged prefill-bound run, served with prefix caching on and a budget that holds every prompt
    (8k) in one step: no setting shortens its TTFT, so without a TTFT target it is LOW with the reason; a
    budget smaller than the prompts (chunked prefill) keeps it a finding."""
    import dataclasses

    from kvpilot.doctor.server_config import ServerConfig
    from tests.doctor.scenarios import prefill_bound

    results, metrics, model, gpu = prefill_bound(tmp_path)
    inputs = load_inputs(results, metrics, model, gpu)
    whole = ServerConfig("test", max_num_batched_tokens=8192, enable_prefix_caching=True)
    note = diagnose(dataclasses.replace(inputs, server_config=whole))
    finding = next(f for f in note.findings if f.rule_id == "prefill-bound")
    assert finding.severity is Severity.LOW and "no server setting shortens this" in finding.summary
    chunked = dataclasses.replace(whole, max_num_batched_tokens=2048)
    report = diagnose(dataclasses.replace(inputs, server_config=chunked))
    assert report.findings[0].rule_id == "prefill-bound" and report.findings[0].severity is not Severity.LOW
