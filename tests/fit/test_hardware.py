from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.fit.errors import FitError, UnknownGpuError
from kvpilot.fit.hardware import GPUS, cpu_device, get_gpu, parse_device_arg, read_meminfo_bytes

REQUIRED = ["l4", "a10g", "rtx-4090", "l40s", "a100-40gb", "a100-80gb", "h100-pcie", "h100-sxm", "h200",
            "b200", "mi300x"]


def test_catalog_has_the_required_gpus_with_sources() -> None:
    assert set(REQUIRED) <= set(GPUS)
    for device in GPUS.values():
        assert device.memory_bytes > 16 * 2**30 and device.bandwidth_bytes_per_s > 1e11
        assert device.bf16_flops > 1e13 and device.source


def test_h100_sxm_numbers() -> None:
    h100 = get_gpu("H100-SXM")
    assert (h100.bandwidth_bytes_per_s, h100.bf16_flops, h100.fp8_flops) == (3.35e12, 989.5e12, 1979e12)
    assert get_gpu("a100-80gb").fp8_flops is None  # Ampere has no fp8 tensor cores


def test_device_arg_with_count() -> None:
    group = parse_device_arg("h100-sxm:8")
    assert group.device.name == "h100-sxm" and group.count == 8
    assert parse_device_arg("l4").count == 1


@pytest.mark.parametrize("bad", ["h100-sxm:0", "h100-sxm:x", "h100-sxm:-1", "cpu:2"])
def test_bad_counts_are_errors(bad: str) -> None:
    with pytest.raises(FitError):
        parse_device_arg(bad)


def test_unknown_gpu_suggests_close_names() -> None:
    with pytest.raises(UnknownGpuError, match="Did you mean: h200"):
        get_gpu("h20")


def test_cpu_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  100 kB\n")
    assert read_meminfo_bytes("MemTotal", meminfo) == 24576000 * 1024
    assert read_meminfo_bytes("MemTotal", tmp_path / "missing") is None
    cpu = cpu_device(bandwidth_gbps=12.5, memory_bytes=8 * 2**30)
    assert (cpu.bandwidth_bytes_per_s, cpu.memory_bytes, cpu.is_gpu) == (12.5e9, 8 * 2**30, False)
    assert cpu_device().bandwidth_bytes_per_s == 25e9
