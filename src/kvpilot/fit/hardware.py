"""Hardware catalog: GPUs (memory, bandwidth, dense TFLOP/s, with sources) and this machine's CPU.

Memory is the total the driver reports (nvidia-smi's MiB figure), which is what vLLM multiplies by
`--gpu-memory-utilization`. TFLOP/s are dense tensor-core peaks (no 2:4 sparsity). fp8 is None where the
chip has no fp8 tensor cores (Ampere).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from kvpilot.fit.calibration import DeviceRates, MachineProfile
from kvpilot.fit.errors import FitError, UnknownGpuError, suggest
from kvpilot.fit.fingerprint import catalog_gpu_for

MIB = 2**20
GIB = 2**30
# MACHINE-FACTS.md (2-vCPU AMD EPYC, measured 2026-11-22): ~25 GB/s memory read, torch.mm bf16 165 GFLOP/s.
CPU_DEFAULT_BANDWIDTH_GBPS = 25.0
CPU_BF16_TFLOPS = 0.165


@dataclass(frozen=True)
class Device:
    """One accelerator (or the CPU). Invariant: memory, bandwidth and bf16 FLOP/s are positive.

    Nominal devices carry datasheet peaks and no step overhead; a calibrated one (``calibrated``) carries what
    this machine measured with kvpilot's kernels (kvpilot.fit.calibration), its float32 GEMM rate and the fixed
    time an engine step takes besides its reads and FLOPs."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float | None
    source: str
    is_gpu: bool = True
    fp32_flops: float | None = None
    step_overhead_seconds: float = 0.0
    calibrated: bool = False


@dataclass(frozen=True)
class DeviceGroup:
    """`count` identical devices used with tensor parallelism."""

    device: Device
    count: int = 1


def _gpu(name: str, mib: int, tb_s: float, bf16_tf: float, fp8_tf: float | None, source: str) -> Device:
    return Device(name, mib * MIB, tb_s * 1e12, bf16_tf * 1e12, fp8_tf * 1e12 if fp8_tf else None, source)


GPUS: dict[str, Device] = {
    d.name: d
    for d in (
        _gpu("l4", 23034, 0.300, 121.0, 242.0, "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4)"),
        _gpu("a10g", 23028, 0.600, 70.0, None,
             "AWS EC2 G5 (A10G) specs as compared in baseten.co 'NVIDIA A10 vs A10G'; no NVIDIA datasheet"),
        _gpu("rtx-4090", 24564, 1.008, 165.2, 330.3,
             "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090, FP32 accumulate)"),
        _gpu("l40s", 46068, 0.864, 362.05, 733.0, "NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s)"),
        _gpu("a100-40gb", 40960, 1.555, 312.0, None, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB)"),
        _gpu("a100-80gb", 81920, 2.039, 312.0, None, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)"),
        _gpu("h100-pcie", 81559, 2.0, 756.0, 1513.0, "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe)"),
        _gpu("h100-sxm", 81559, 3.35, 989.5, 1979.0, "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)"),
        _gpu("h200", 143771, 4.8, 989.5, 1979.0, "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)"),
        _gpu("b200", 183359, 8.0, 2250.0, 4500.0, "NVIDIA HGX B200 datasheet (per GPU: 1/8 of the 8-GPU board)"),
        _gpu("mi300x", 196608, 5.3, 1307.4, 2614.9, "AMD Instinct MI300X accelerator datasheet"),
    )
}
_GPU_ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "4090": "rtx-4090"}


def get_gpu(name: str) -> Device:
    """Catalog GPU by name (case-insensitive, a few aliases); UnknownGpuError with close matches."""
    key = name.strip().lower()
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise UnknownGpuError(suggest(name, [*GPUS, "cpu"], "GPU"))
    return GPUS[key]


def catalog_name_of(device_name: str) -> str | None:
    """The catalog GPU a driver's device name is ("NVIDIA H200" -> "h200"); None when the catalog lacks it."""
    return catalog_gpu_for(device_name, list(GPUS), _GPU_ALIASES)


def read_meminfo_bytes(field: str = "MemTotal", path: Path = Path("/proc/meminfo")) -> int | None:
    """A /proc/meminfo field in bytes, or None where the file or field is missing (non-Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def cpu_device(bandwidth_gbps: float | None = None, memory_bytes: int | None = None) -> Device:
    """This machine's CPU: RAM from /proc/meminfo, bandwidth measured elsewhere (default 25 GB/s)."""
    memory = memory_bytes or read_meminfo_bytes() or 16 * GIB
    bandwidth = bandwidth_gbps or CPU_DEFAULT_BANDWIDTH_GBPS
    if bandwidth <= 0:
        raise FitError(f"--cpu-bandwidth-gbps must be positive, got {bandwidth}.")
    return Device(
        name="cpu",
        memory_bytes=memory,
        bandwidth_bytes_per_s=bandwidth * 1e9,
        bf16_flops=CPU_BF16_TFLOPS * 1e12,
        fp8_flops=None,
        source="RAM: /proc/meminfo MemTotal; bandwidth and bf16 FLOP/s: MACHINE-FACTS.md (2-vCPU EPYC)",
        is_gpu=False,
    )


def with_measured_rates(device: Device, rates: DeviceRates | None) -> Device:
    """`device` with this machine's measured rates (its memory stays the catalog's or /proc's); unchanged
    without rates."""
    if rates is None:
        return device
    return replace(device, bandwidth_bytes_per_s=rates.bandwidth_bytes_per_s, bf16_flops=rates.bf16_flops,
                   fp32_flops=rates.fp32_flops, step_overhead_seconds=rates.step_overhead_seconds, calibrated=True,
                   source=f"calibrated on this machine ({rates.name}) with kvpilot's kernels")


def parse_device_arg(arg: str, cpu_bandwidth_gbps: float | None = None,
                     profile: MachineProfile | None = None) -> DeviceGroup:
    """`--gpu NAME[:count]`, e.g. 'h100-sxm:8', 'l4', 'cpu'. Count must be a positive integer. With this
    machine's calibration `profile`, the CPU and the catalog GPU it measured get its rates (an explicit
    --cpu-bandwidth-gbps keeps the nominal CPU)."""
    name, _, count_text = arg.partition(":")
    count = 1
    if count_text:
        if not count_text.isdigit() or int(count_text) < 1:
            raise FitError(f"bad --gpu '{arg}': the count after ':' must be a positive integer, e.g. h100-sxm:8.")
        count = int(count_text)
    if name.strip().lower() == "cpu":
        if count != 1:
            raise FitError("--gpu cpu takes no count: the CPU is one device.")
        cpu = cpu_device(cpu_bandwidth_gbps)
        keep_nominal = cpu_bandwidth_gbps is not None or profile is None
        return DeviceGroup(cpu if keep_nominal else with_measured_rates(cpu, profile.cpu), 1)
    device = get_gpu(name)
    return DeviceGroup(with_measured_rates(device, profile.rates_for(device.name) if profile else None), count)
