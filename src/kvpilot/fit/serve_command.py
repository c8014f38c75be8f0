"""The `kvpilot serve` command lines `kvpilot fit` recommends, in the model forms kvpilot accepts.

kvpilot takes a GGUF file, an HF directory (config.json + *.safetensors), a Hugging Face Hub id (downloaded
once into the HF cache), or with `--load-format dummy` a catalog name or config.json (random weights, real
shapes).

Invariant: every command's argv (after `kvpilot serve`) parses under `kvpilot serve`'s flags, and each line is
runnable as printed once the local path it names exists (a shell comment says how to get it). Which
architectures kvpilot runs is the model registry's knowledge, which this torch-free planner does not import:
the `kvpilot` command installs the registry's check with `set_serve_check`; a model it refuses gets no
`kvpilot serve` line, only a note saying why.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.fit.model_catalog import canonical_name, get_repo_id
from kvpilot.fit.model_source import LoadedModel

CATALOG_PREFIX, GGUF_PREFIX, CONFIG_PREFIX = "catalog: ", "GGUF file ", "config file "

# An HF config dict -> None when `kvpilot serve` runs the model, else why not.
ServeCheck = Callable[[dict[str, Any]], "str | None"]
_serve_check: ServeCheck | None = None


def set_serve_check(check: ServeCheck | None) -> None:
    """Installs the check that decides whether `kvpilot serve` lines are printed for a model."""
    global _serve_check
    _serve_check = check


def unservable_reason(model: LoadedModel) -> str | None:
    """Why `kvpilot serve` would refuse `model` (None: it runs it, or no check is installed)."""
    return _serve_check(model.hf_config) if _serve_check is not None and model.hf_config else None


@dataclass(frozen=True)
class ServeCommand:
    """`kvpilot serve <argv>`, with an optional note printed as a trailing shell comment."""

    argv: tuple[str, ...]
    note: str | None = None

    def line(self) -> str:
        text = "kvpilot serve " + shlex.join(self.argv)
        return f"{text}   # {self.note}" if self.note else text


def model_arguments(model: LoadedModel) -> list[tuple[tuple[str, ...], str | None]]:
    """(model flags, note) pairs for the model fit planned: its own path, or for a catalog model its hub id
    and, runnable right away without a download, the same shapes with dummy weights."""
    source = model.source
    if source.startswith(GGUF_PREFIX):
        return [(("--model", source.removeprefix(GGUF_PREFIX)), None)]
    if source.startswith(CONFIG_PREFIX):
        config = Path(source.removeprefix(CONFIG_PREFIX))
        if any(config.parent.glob("*.safetensors")):
            return [(("--model", str(config.parent)), None)]
        return [(("--model", str(config), "--load-format", "dummy"), "random weights: no *.safetensors next to it")]
    try:
        name = canonical_name(model.spec.name)
        repo_id = get_repo_id(name)
    except ValueError:
        return []
    return [(("--model", repo_id), "downloaded once into the Hugging Face cache (gated models: set HF_TOKEN)"),
            (("--model", name, "--load-format", "dummy"), "random weights, real shapes: try the flags now")]


def kvpilot_serve_commands(model: LoadedModel, engine_args: list[str]) -> list[ServeCommand]:
    """The recommended `kvpilot serve` lines: one per model form, each with the plan's engine flags; none for
    a model kvpilot does not run (see unservable_reason)."""
    if unservable_reason(model) is not None:
        return []
    return [ServeCommand((*model_args, *engine_args), note) for model_args, note in model_arguments(model)]
