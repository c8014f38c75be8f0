"""deploy/kubernetes/components/gpu: the base Deployment on NVIDIA GPU nodes. Built with kustomize over the
base as a user's overlay would, then checked: valid for the Kubernetes API, the CUDA image of this version, one
`nvidia.com/gpu`, arguments the real `kvpilot serve` command line accepts (through Dockerfile.cuda's
entrypoint), room for the Hub download and Triton's caches on the cache volume, shared memory for NCCL."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kvpilot.cli import app
from tests.deploy.assets import DEPLOY, KUBERNETES, KUSTOMIZATION
from tests.deploy.docker_assets import entrypoint, run_env
from tests.deploy.test_manifests import _kustomize, _validate

CUDA = DEPLOY / "docker" / "Dockerfile.cuda"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("gpu-overlay")
    base = os.path.relpath(KUBERNETES, folder)  # kustomize refuses absolute paths
    (folder / KUSTOMIZATION).write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [base],
        "components": [f"{base}/components/gpu"]}))
    docs = _kustomize(folder)
    for doc in docs:
        _validate(doc)
    (found,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    return found


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_one_gpu_from_the_cuda_image_of_this_version(deployment: dict[str, Any]) -> None:
    import kvpilot

    container = _container(deployment)
    assert container["image"] == f"kvpilot-cuda:{kvpilot.__version__}"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    tolerations = deployment["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_the_arguments_are_a_command_line_kvpilot_serve_accepts(deployment: dict[str, Any]) -> None:
    import kvpilot.server.cli as serve_cli

    captured: dict[str, Any] = {}

    def run_server(engine_args: Any, server_args: Any, uvicorn_log_level: str = "warning") -> int:
        captured.update(engine_args=engine_args)
        return 0

    argv = entrypoint(CUDA)[1:] + _container(deployment)["args"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serve_cli, "run_server", run_server)
        result = CliRunner().invoke(app, argv, env={"KVPILOT_API_KEY": "k"})
    assert result.exit_code == 0, f"`kvpilot {' '.join(argv)}` was refused: {result.output}"
    args = captured["engine_args"]
    assert args.model == "Qwen/Qwen3-0.6B" and args.gpu_memory_utilization == 0.9


def test_caches_fit_the_cache_volume_and_shared_memory_is_mounted(deployment: dict[str, Any]) -> None:
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in _container(deployment)["volumeMounts"]}
    env = run_env(CUDA)
    for name in ("HF_HOME", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
        assert Path(env[name]).is_relative_to(mounts["cache"]), f"{name} is not on the cache volume"
    assert volumes["cache"]["emptyDir"]["sizeLimit"] == "64Gi", "room for a downloaded model's weights"
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    hf_token = [e for e in _container(deployment)["env"] if e["name"] == "HF_TOKEN"]
    assert hf_token and hf_token[0]["valueFrom"]["secretKeyRef"]["optional"] is True
