"""deploy/docker/Dockerfile, parsed with dockerfile-parse: its stages, instructions and build arguments.

Invariant: `instructions(name)` keeps the file's order; `stage_of` counts FROM lines from 0, so the last
stage (the image that runs) is `num_stages() - 1`.
"""

from __future__ import annotations

import json
import re
import shlex
from functools import lru_cache
from typing import Any

from dockerfile_parse import DockerfileParser

from tests.deploy.assets import DOCKERFILE


@lru_cache(maxsize=1)
def structure() -> tuple[dict[str, Any], ...]:
    """Each instruction with its stage index added (`stage`: -1 before the first FROM)."""
    stage = -1
    items = []
    for item in DockerfileParser(path=str(DOCKERFILE)).structure:
        if item["instruction"] == "FROM":
            stage += 1
        items.append({**item, "stage": stage})
    return tuple(items)


def num_stages() -> int:
    return 1 + max(item["stage"] for item in structure())


def instructions(name: str, stage: int | None = None) -> list[str]:
    return [item["value"] for item in structure()
            if item["instruction"] == name and (stage is None or item["stage"] == stage)]


def build_args() -> dict[str, str]:
    """ARG NAME=default, from every stage (names are unique in this Dockerfile)."""
    pairs = (value.split("=", 1) for value in instructions("ARG"))
    return {pair[0]: pair[1].strip('"') if len(pair) == 2 else "" for pair in pairs}


def expand(text: str) -> str:
    """${NAME} / $NAME replaced by the ARG defaults."""
    args = build_args()
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


def run_env() -> dict[str, str]:
    """The environment of the image that runs (the last stage's ENV, as dockerfile-parse resolves it)."""
    return DockerfileParser(path=str(DOCKERFILE)).envs


def entrypoint() -> list[str]:
    (value,) = instructions("ENTRYPOINT", stage=num_stages() - 1)
    return json.loads(value)  # the exec form; the shell form would not pass signals (SIGTERM drain)


def exposed_ports() -> set[int]:
    return {int(port.split("/")[0]) for value in instructions("EXPOSE") for port in value.split()}


def run_commands(stage: int | None = None) -> list[list[str]]:
    """Each RUN's shell words, split at `&&` into separate commands, ARGs expanded."""
    commands = []
    for value in instructions("RUN", stage):
        for part in expand(value).split("&&"):
            commands.append(shlex.split(part))
    return commands
