"""Calibration profiles (torch-free side): stored and read back under the machine's fingerprint, used by fit's
roofline for the CPU and the catalog GPU they measured, ignored with a note when they describe another machine."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvpilot.fit.calibration import DeviceRates, MachineProfile, load_profile, profile_path, save_profile
from kvpilot.fit.cli import fit_command
from kvpilot.fit.errors import FitError
from kvpilot.fit.fingerprint import MachineFingerprint, cpu_int8_path, current_fingerprint
from kvpilot.fit.hardware import catalog_name_of, parse_device_arg

app = typer.Typer()
app.command("fit")(fit_command)
app.command("noop")(lambda: None)  # a second command keeps `fit` a subcommand, as in kvpilot.cli

CPU_RATES = DeviceRates("cpu", bandwidth_bytes_per_s=10e9, bf16_flops=200e9, fp32_flops=100e9,
                        step_overhead_seconds=0.002)
H200_RATES = DeviceRates("NVIDIA H200", bandwidth_bytes_per_s=4.0e12, bf16_flops=700e12, fp32_flops=50e12,
                         step_overhead_seconds=0.0005, catalog_name="h200")


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path))
    return tmp_path


def _profile(fingerprint: MachineFingerprint | None = None) -> MachineProfile:
    return MachineProfile(fingerprint or current_fingerprint(), CPU_RATES, H200_RATES, 1.0e9, "kvpilot kernels")


def _fit_json(*args: str) -> tuple[dict, str]:
    result = CliRunner().invoke(app, ["fit", "smollm2-135m", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


def test_a_profile_round_trips_through_its_file(cache: Path) -> None:
    profile = _profile()
    path = save_profile(profile)
    assert path == cache / "calibration" / f"{profile.fingerprint.key()}.json"
    lookup = load_profile()
    assert lookup.profile == profile and lookup.note is None and lookup.path == path


def test_no_profile_means_nominal_rates_and_no_note(cache: Path) -> None:
    assert load_profile().profile is None and load_profile().note is None
    device = parse_device_arg("cpu", profile=None).device
    assert not device.calibrated and device.step_overhead_seconds == 0.0


def test_fit_plans_on_the_calibrated_cpu(cache: Path) -> None:
    nominal, _ = _fit_json("--dtype", "bf16")
    save_profile(_profile())
    data, _ = _fit_json("--dtype", "bf16")
    device = data["group"]["device"]
    assert (nominal["group"]["device"]["calibrated"], device["calibrated"]) == (False, True)
    assert device["bandwidth_bytes_per_s"] == 10e9 and device["step_overhead_seconds"] == 0.002
    one = data["roofline"]["decode_single"]
    # the step: the weights and KV read at the measured bandwidth, plus the measured overhead
    assert one["step_seconds"] == pytest.approx(one["memory_seconds"] + 0.002)
    assert one["memory_seconds"] == pytest.approx(nominal["roofline"]["decode_single"]["memory_seconds"] * 25 / 10)
    # bf16 weights multiply at the faster of the two measured GEMM rates
    assert data["roofline"]["peak_flops"] == 200e9


def test_fit_tables_say_calibrated_or_nominal(cache: Path) -> None:
    nominal = CliRunner().invoke(app, ["fit", "smollm2-135m"]).stdout
    save_profile(_profile())
    calibrated = CliRunner().invoke(app, ["fit", "smollm2-135m"]).stdout
    assert "(nominal)" in nominal and "nominal rates" in nominal and "step overhead" not in nominal
    assert "(calibrated)" in calibrated and "calibrated rates" in calibrated
    assert "step overhead (measured)" in calibrated and "2.0 ms" in calibrated


def test_the_measured_gpu_is_calibrated_and_other_catalog_gpus_stay_nominal() -> None:
    profile = _profile()
    h200 = parse_device_arg("h200:2", profile=profile)
    assert h200.count == 2 and h200.device.calibrated and h200.device.bandwidth_bytes_per_s == 4.0e12
    assert h200.device.memory_bytes == parse_device_arg("h200").device.memory_bytes  # memory stays the catalog's
    assert not parse_device_arg("h100-sxm", profile=profile).device.calibrated
    # an explicit --cpu-bandwidth-gbps keeps the nominal CPU
    assert not parse_device_arg("cpu", cpu_bandwidth_gbps=30, profile=profile).device.calibrated


@pytest.mark.parametrize("name, entry", [("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
                                         ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
                                         ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4"),
                                         ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("Tesla T4", None)])
def test_driver_gpu_names_map_to_catalog_entries(name: str, entry: str | None) -> None:
    assert catalog_name_of(name) == entry


def test_a_profile_of_another_machine_is_ignored_with_a_note(cache: Path) -> None:
    here = current_fingerprint()
    other = replace(here, num_cpus=here.num_cpus + 62, cpu_model_name="Other CPU")
    save_profile(_profile(other))  # a shared home directory: another machine's profile beside ours
    lookup = load_profile()
    assert lookup.profile is None and "other machines" in lookup.note and "--calibrate" in lookup.note
    # a file under this machine's key that was measured elsewhere (copied over) is not trusted either
    profile_path(here).write_text(json.dumps(_profile(other).to_json()))
    lookup = load_profile()
    assert lookup.profile is None and "measured on Other CPU" in lookup.note
    data, stderr = _fit_json()
    assert data["group"]["device"]["calibrated"] is False and "measured on Other CPU" in stderr


def test_a_damaged_profile_is_ignored_with_a_note(cache: Path) -> None:
    path = profile_path(current_fingerprint())
    path.parent.mkdir(parents=True)
    path.write_text('{"schema_version": 1, "cpu": {}}')
    lookup = load_profile()
    assert lookup.profile is None and "not a kvpilot calibration profile" in lookup.note
    with pytest.raises(FitError, match="rates must be positive"):
        DeviceRates("cpu", 0.0, 1.0, 1.0, 0.0)


def test_the_fingerprint_reads_cpuinfo_and_the_nvidia_driver(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                       "model name\t: AMD EPYC 9R14\n")
    gpu = tmp_path / "gpus" / "0000:00:1e.0"
    gpu.mkdir(parents=True)
    (gpu / "information").write_text("Model: \t\t NVIDIA H200\nIRQ:   42\n")
    fingerprint = current_fingerprint(cpuinfo, tmp_path / "gpus")
    assert (fingerprint.cpu_model_name, fingerprint.cpu_family, fingerprint.cpu_model_number,
            fingerprint.gpu_name) == ("AMD EPYC 9R14", "25", "17", "NVIDIA H200")
    assert fingerprint.num_cpus >= 1
    assert current_fingerprint(cpuinfo, tmp_path / "none").gpu_name == ""
    assert fingerprint.key() != replace(fingerprint, gpu_name="").key()


def test_the_int8_path_follows_the_cpu_flags(tmp_path: Path) -> None:
    """fit's int8 copies of packed weights: the kernels' has_vnni (AVX-512 VNNI and BW), their has_int8_tiles (AVX2
    and FMA), else none."""
    zen4, zen3, old = tmp_path / "zen4", tmp_path / "zen3", tmp_path / "old"
    zen4.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16\n")
    zen3.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    old.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx\n")
    assert [cpu_int8_path(p) for p in (zen4, zen3, old)] == ["vnni", "avx2", "none"]
    assert cpu_int8_path(tmp_path / "missing") == "none"
