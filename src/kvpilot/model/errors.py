"""Errors a user can hit while loading a model: each message names the file and what to do."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvpilot.fit.errors import ConfigError


class ModelLoadError(Exception):
    """A model could not be loaded: missing or corrupt file, unsupported architecture, shape mismatch."""


@contextmanager
def config_errors_as_load_errors(source: str | None = None) -> Iterator[None]:
    """Inside, a ConfigError from kvpilot.fit's torch-free parsers (HF config dict, GGUF header) surfaces as
    a ModelLoadError, so the loader's callers catch one type. The message is kept; it is prefixed with
    `source` unless it already names it."""
    try:
        yield
    except ConfigError as exc:
        message = str(exc)
        if source is not None and not message.startswith(source):
            message = f"{source}: {message}"
        raise ModelLoadError(message) from exc
