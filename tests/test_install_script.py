"""Issue 46 item 1: scripts/install.sh picks the torch build for the machine: the CPU build on a machine
without an NVIDIA GPU (PyTorch's CPU index, or a CPU wheel pip already finds; never the CUDA packages), the
CUDA build where `nvidia-smi` lists a GPU. pip's dry-run reports show what each path would install; nothing
is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "install.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH = "torch==2.13.0"


def _plan(env: dict[str, str]) -> str:
    result = subprocess.run(["bash", str(SCRIPT), "--print-torch-plan"], env=env, capture_output=True, text=True,
                            timeout=30, check=True)
    return result.stdout.strip()


def _fake_gpu_path(tmp_path: Path) -> str:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    return f"{tmp_path}:{os.environ['PATH']}"


def test_plan_follows_the_machine(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVPILOT_TORCH"}
    if os.uname().sysname == "Linux" and os.uname().machine == "x86_64":
        assert _plan(env) == "cpu"
    assert _plan({**env, "PATH": _fake_gpu_path(tmp_path)}) == "cuda"
    assert _plan({**env, "PATH": _fake_gpu_path(tmp_path), "KVPILOT_TORCH": "cpu"}) == "cpu"


def _dry_run(*args: str, env: dict[str, str] | None = None) -> list[str] | None:
    """The names pip would install for torch with `args`; None when it cannot resolve (index unreachable)."""
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                             "--report", "-", "--retries", "1", "--timeout", "20", TORCH, *args],
                            capture_output=True, text=True, timeout=600, env=env)
    if result.returncode != 0:
        return None
    return [item["metadata"]["name"].lower() for item in json.loads(result.stdout)["install"]]


def _cuda_names(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith(("nvidia-", "cuda-")) or n == "triton"]


@pytest.mark.slow
def test_public_index_alone_would_pull_cuda_and_the_script_notices() -> None:
    """The GPU path: PyPI's Linux wheel is the CUDA build, which the script installs only where a GPU is."""
    if os.uname().machine != "x86_64":
        pytest.skip("PyPI's torch wheels are CPU builds on this platform")
    machine_pip = ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_INDEX_URL")
    public_only = {**{k: v for k, v in os.environ.items() if k not in machine_pip}, "PIP_CONFIG_FILE": os.devnull,
                   "PIP_INDEX_URL": "https://pypi.org/simple", "PYTHON": sys.executable}
    verdict = subprocess.run(["bash", str(SCRIPT), "--print-torch-resolution"], env=public_only,
                             capture_output=True, text=True, timeout=600)
    if verdict.stdout.strip() == "no-cuda" and subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", os.devnull, "--dry-run", TORCH],
            env=public_only, capture_output=True, timeout=120).returncode != 0:
        pytest.skip("PyPI is unreachable from this machine")
    assert verdict.stdout.strip() == "cuda"  # so a CPU machine with no CPU index is refused, not flooded


@pytest.mark.slow
def test_cpu_path_resolves_no_cuda_package() -> None:
    """The CPU path: PyTorch's CPU index (or, where it is unreachable, the wheel pip already finds here)."""
    names = _dry_run("--index-url", CPU_INDEX)
    if names is None:
        pytest.skip(f"neither {CPU_INDEX} nor a local torch wheel is reachable from this machine")
    assert "torch" in names and _cuda_names(names) == [], names
