"""MachineFingerprint: what identifies the hardware a calibration profile was measured on (torch-free).

CPU model name, family and model number (/proc/cpuinfo), the cores this process may run on, and the NVIDIA
GPU's name (the driver's /proc entry, so no torch or nvidia-smi is needed to read it). A profile measured
under another fingerprint describes other hardware (another instance type, a container given fewer cores)
and is not used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

CPUINFO_PATH = Path("/proc/cpuinfo")
NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class MachineFingerprint:
    """Invariant: num_cpus >= 1; gpu_name is "" on a machine without an NVIDIA GPU."""

    cpu_model_name: str
    cpu_family: str
    cpu_model_number: str
    num_cpus: int
    gpu_name: str = ""

    def key(self) -> str:
        """A short stable file-name key: the first 16 hex digits of the fields' SHA-256."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        gpu = f", {self.gpu_name}" if self.gpu_name else ""
        return (f"{self.cpu_model_name} (family {self.cpu_family} model {self.cpu_model_number}), "
                f"{self.num_cpus} cores{gpu}")


def _cpuinfo_field(text: str, field: str) -> str:
    match = re.search(rf"^{field}\s*:\s*(.*)$", text, re.MULTILINE)
    return match.group(1).strip() if match else ""


def gpu_name(gpus_dir: Path = NVIDIA_GPUS_DIR) -> str:
    """The first NVIDIA GPU's model name ("NVIDIA H200"), "" when there is none (or no driver)."""
    try:
        infos = sorted(gpus_dir.glob("*/information"))
        text = infos[0].read_text() if infos else ""
    except OSError:
        return ""
    return _cpuinfo_field(text, "Model")


def cpu_flags(cpuinfo_path: Path = CPUINFO_PATH) -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them ("avx2", "avx512_vnni", ...); empty where it cannot be
    read (not Linux, not x86)."""
    try:
        return frozenset(_cpuinfo_field(cpuinfo_path.read_text(), "flags").split())
    except OSError:
        return frozenset()


def cpu_has_fast_bf16(cpuinfo_path: str | Path = CPUINFO_PATH) -> bool:
    """True when the CPU computes bf16 natively (AVX512_BF16 or AMX). Without it, torch emulates bf16
    matmuls, which is 5-40x slower than float32 (measured on an AVX-512 Xeon without bf16), and kvpilot's
    --dtype auto is float32 there (model/dtypes.py)."""
    return bool(cpu_flags(Path(cpuinfo_path)) & {"avx512_bf16", "amx_bf16"})


def cpu_has_amx_bf16(cpuinfo_path: str | Path = CPUINFO_PATH) -> bool:
    """True when the CPU has AMX tiles for bf16 (oneDNN's GEMMs run on them: the decode copies and layout of
    model/layers/onednn_linear.py, and fit's note of them)."""
    return "amx_bf16" in cpu_flags(Path(cpuinfo_path))


def cpu_int8_path(cpuinfo_path: Path = CPUINFO_PATH) -> str:
    """Which int8 path this CPU takes for packed weights in bf16, read here without building the kernels:
    "vnni" (AVX-512 VNNI and BW: the kernels' has_vnni), "avx2" (AVX2 and FMA: has_int8_tiles; the same copies, no
    interleaved ones) or "none"."""
    flags = cpu_flags(cpuinfo_path)
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return "vnni"
    return "avx2" if {"avx2", "fma"} <= flags else "none"


def current_fingerprint(cpuinfo_path: Path = CPUINFO_PATH, gpus_dir: Path = NVIDIA_GPUS_DIR) -> MachineFingerprint:
    """This machine's fingerprint; fields it cannot read (non-Linux) are empty."""
    try:
        text = cpuinfo_path.read_text()
    except OSError:
        text = ""
    # the cores this process may use, what the measurement ran on (a container may get fewer than the host)
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return MachineFingerprint(
        cpu_model_name=_cpuinfo_field(text, "model name"), cpu_family=_cpuinfo_field(text, "cpu family"),
        cpu_model_number=_cpuinfo_field(text, "model"), num_cpus=num_cpus, gpu_name=gpu_name(gpus_dir))


def catalog_gpu_for(device_name: str, catalog_names: list[str], aliases: dict[str, str]) -> str | None:
    """The catalog entry a driver's GPU name is ("NVIDIA H200" -> "h200", "NVIDIA A100-SXM4-80GB" ->
    "a100-80gb"): the first whose '-'-separated parts all appear among the name's words, else an alias among
    the words ("NVIDIA H100 80GB HBM3" -> "h100" -> "h100-sxm"); None if neither matches."""
    words = set(re.split(r"[\s\-_]+", device_name.lower()))
    for name in catalog_names:
        if set(name.split("-")) <= words:
            return name
    return next((aliases[word] for word in sorted(words) if word in aliases), None)
