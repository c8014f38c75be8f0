"""`kvpilot fit --calibrate` for real: kvpilot's kernels measure this machine (at test sizes: a weight that fits
the caches, a small GEMM, a few engine steps), the profile is stored, and the next plan uses it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpilot.calibrate import CalibrationSizes, calibrate
from kvpilot.cli import app
from kvpilot.fit.calibration import load_profile, set_calibrator

FAST = CalibrationSizes(cpu_weight_bytes=8 * 2**20, gpu_weight_bytes=64 * 2**20, cpu_gemm_rows=64, cpu_gemm_dim=256,
                        gpu_gemm_rows=1024, gpu_gemm_dim=1024, num_repeats=3, num_decode_steps=8)


@pytest.fixture()
def fast_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path))
    set_calibrator(lambda: calibrate(FAST))
    yield tmp_path
    from kvpilot import cli

    set_calibrator(cli._calibrate)


def test_calibrate_measures_stores_and_fit_then_plans_on_it(fast_calibration: Path) -> None:
    result = CliRunner().invoke(app, ["fit", "--calibrate"])
    assert result.exit_code == 0, result.output
    assert "memory bandwidth" in result.stdout and "engine step overhead" in result.stdout
    assert "stored in" in result.stdout and str(fast_calibration) in result.stdout.replace("\n", "")
    lookup = load_profile()
    assert lookup.profile is not None and lookup.path.parent.parent == fast_calibration
    cpu = lookup.profile.cpu
    # plausible for any CPU: bytes and FLOPs per second well above a slow disk's, an engine step under a second
    assert cpu.bandwidth_bytes_per_s > 1e8 and cpu.bf16_flops > 1e8 and cpu.fp32_flops > 1e8
    assert 0 < cpu.step_overhead_seconds < 1.0

    plan = CliRunner().invoke(app, ["fit", "smollm2-135m", "--gpu", "cpu", "--json"])
    device = json.loads(plan.stdout)["group"]["device"]
    assert device["calibrated"] is True and device["bandwidth_bytes_per_s"] == cpu.bandwidth_bytes_per_s
    assert device["step_overhead_seconds"] == cpu.step_overhead_seconds
