"""Fixtures for the fit tests: catalog models load instantly; the real GGUF header is read once.

`gguf_path` (the embedded SmolLM2 GGUF) comes from tests/conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.fit.model_source import LoadedModel, load_model


@pytest.fixture(scope="session")
def embedded_model(gguf_path: Path) -> LoadedModel:
    """The embedded SmolLM2 GGUF as the planner sees it (reading its header takes a few seconds)."""
    return load_model(str(gguf_path))
