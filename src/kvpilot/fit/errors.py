"""Errors a `kvpilot fit` user can cause. Each message says what to do; the CLI prints it and exits 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FitError(ValueError):
    """Base class: bad input to the planner (the message is one line, meant for the user)."""


class UnknownModelError(FitError):
    """A model name that is neither in the catalog nor an existing file."""


class UnknownGpuError(FitError):
    """A `--gpu` name that is not in the hardware catalog."""


class ConfigError(FitError):
    """A config.json or GGUF that cannot be read or lacks a field the planner needs."""


class GgufError(ConfigError):
    """A GGUF file that is missing, truncated or corrupt, or whose header describes an architecture
    kvpilot cannot turn into an HF config (the message names the file)."""


def suggest(name: str, candidates: Iterable[str], what: str) -> str:
    """`unknown <what> 'name'` plus up to three close matches (difflib) and the full choice list."""
    choices = sorted(set(candidates))
    close = difflib.get_close_matches(name.lower(), choices, n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return f"unknown {what} '{name}'.{hint} Known: {', '.join(choices)}."
