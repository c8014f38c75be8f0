"""The doctor judges decode by this machine's calibrated limit when `kvpilot fit --calibrate` measured it: the
verdict, the headroom and the decode rule say so, with the calibrated numbers; another machine's profile is
ignored with a note."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvpilot.doctor.diagnose import DoctorReport, diagnose
from kvpilot.doctor.inputs import inputs_from_documents
from kvpilot.fit.calibration import DeviceRates, MachineProfile, profile_path, save_profile
from kvpilot.fit.fingerprint import current_fingerprint
from tests.doctor.scenarios import SCENARIOS

# far faster than the nominal 25 GB/s CPU: the scenario's 30 ms tokens become slow against it
FAST_CPU = DeviceRates("cpu", bandwidth_bytes_per_s=100e9, bf16_flops=1e12, fp32_flops=0.5e12,
                       step_overhead_seconds=0.001)


@pytest.fixture()
def documents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, str]]:
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "cache"))
    paths, _, _, _ = SCENARIOS["decode-bound"](tmp_path)  # 30 ms per token at batch 1
    return [(json.loads(Path(p).read_text()), p) for p in paths]


def _report(documents: list[tuple[dict, str]]) -> DoctorReport:
    return diagnose(inputs_from_documents(documents, model="smollm2-135m", gpu="cpu"))


def _headroom_line(report: DoctorReport) -> str:
    return next(line for line in report.headroom if line.startswith("decode at"))


def test_the_verdict_and_rules_use_this_machines_calibrated_limit(documents: list[tuple[dict, str]]) -> None:
    nominal = _report(documents)
    save_profile(MachineProfile(current_fingerprint(), FAST_CPU, None, 1.0e9, "kvpilot kernels"))
    calibrated = _report(documents)

    assert nominal.roofline["calibrated"] is False and "of the roofline (smollm2-135m on cpu)" in nominal.verdict
    assert "nominal rates" in _headroom_line(nominal)
    assert calibrated.roofline["calibrated"] is True
    # smollm2-135m's bf16 weights (~0.27 GB) at 100 GB/s plus the 1 ms step: ~3.7 ms of a 30 ms token
    floor_ms = calibrated.roofline["decode_step_ms"]
    assert 3.0 < floor_ms < 4.5 and floor_ms != nominal.roofline["decode_step_ms"]
    share = calibrated.roofline_share
    assert share == pytest.approx(floor_ms / 30.0, rel=0.1)
    assert f"decode at {share:.0%} of this machine's calibrated limit (smollm2-135m on cpu)" in calibrated.verdict
    assert _headroom_line(calibrated).startswith(f"decode at {share:.0%} of this machine's calibrated limit")
    # the decode rule judges by it too: 12% is slow, the nominal 36% was not
    decode = {f.rule_id: f for f in calibrated.findings}["decode-bound"]
    assert f"{share:.0%} of this machine's calibrated limit" in decode.summary
    assert any("calibrated" in e.name for e in decode.evidence)
    assert "decode-bound" not in {f.rule_id for f in nominal.findings}


def test_another_machines_profile_is_ignored_with_a_note(documents: list[tuple[dict, str]]) -> None:
    here = current_fingerprint()
    elsewhere = replace(here, cpu_model_name="Other CPU")
    profile_path(here).parent.mkdir(parents=True)
    profile_path(here).write_text(json.dumps(
        MachineProfile(elsewhere, FAST_CPU, None, 1.0e9, "kvpilot kernels").to_json()))
    report = _report(documents)
    assert report.roofline["calibrated"] is False and "of the roofline" in report.verdict
    assert any(line.startswith("note: ignored the calibration profile") and "Other CPU" in line
               for line in report.headroom)
