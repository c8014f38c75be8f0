"""deploy/docker/Dockerfile (or, with `path`, another Dockerfile: Dockerfile.cuda), parsed with dockerfile-parse:
its stages, instructions and build arguments.

Invariant: `instructions(name)` keeps the file's order; `stage_of` counts FROM lines from 0, so the last
stage (the image that runs) is `num_stages() - 1`.
"""

from __future__ import annotations

import io
import json
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any

from dockerfile_parse import DockerfileParser

from tests.deploy.assets import DOCKERFILE


def _parser(path: Path) -> DockerfileParser:
    """The parser over the file's content (given a path not named Dockerfile, it would look for one inside)."""
    return DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))


@lru_cache(maxsize=4)
def structure(path: Path = DOCKERFILE) -> tuple[dict[str, Any], ...]:
    """Each instruction with its stage index added (`stage`: -1 before the first FROM)."""
    stage = -1
    items = []
    for item in _parser(path).structure:
        if item["instruction"] == "FROM":
            stage += 1
        items.append({**item, "stage": stage})
    return tuple(items)


def num_stages(path: Path = DOCKERFILE) -> int:
    return 1 + max(item["stage"] for item in structure(path))


def instructions(name: str, stage: int | None = None, path: Path = DOCKERFILE) -> list[str]:
    return [item["value"] for item in structure(path)
            if item["instruction"] == name and (stage is None or item["stage"] == stage)]


def build_args(path: Path = DOCKERFILE) -> dict[str, str]:
    """ARG NAME=default, from every stage (names are unique in this Dockerfile)."""
    pairs = (value.split("=", 1) for value in instructions("ARG", path=path))
    return {pair[0]: pair[1].strip('"') if len(pair) == 2 else "" for pair in pairs}


def expand(text: str, path: Path = DOCKERFILE) -> str:
    """${NAME} / $NAME replaced by the ARG defaults."""
    args = build_args(path)
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


def run_env(path: Path = DOCKERFILE) -> dict[str, str]:
    """The environment of the image that runs (the last stage's ENV, as dockerfile-parse resolves it)."""
    return _parser(path).envs


def entrypoint(path: Path = DOCKERFILE) -> list[str]:
    (value,) = instructions("ENTRYPOINT", stage=num_stages(path) - 1, path=path)
    return json.loads(value)  # the exec form; the shell form would not pass signals (SIGTERM drain)


def exposed_ports(path: Path = DOCKERFILE) -> set[int]:
    return {int(port.split("/")[0]) for value in instructions("EXPOSE", path=path) for port in value.split()}


def run_commands(stage: int | None = None, path: Path = DOCKERFILE) -> list[list[str]]:
    """Each RUN's shell words, split at `&&` into separate commands, ARGs expanded."""
    commands = []
    for value in instructions("RUN", stage, path):
        for part in expand(value, path).split("&&"):
            commands.append(shlex.split(part))
    return commands
