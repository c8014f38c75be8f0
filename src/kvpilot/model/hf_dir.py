"""Loads a Hugging Face model directory: config.json + *.safetensors (+ tokenizer files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvpilot.model.errors import ModelLoadError


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """config.json of an HF model directory as a dict; a clear error if missing or malformed."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{directory}: no config.json; an HF model directory needs config.json and "
                             "*.safetensors files")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file}: malformed JSON ({exc})") from exc


def load_safetensors_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's *.safetensors files (sharded or not), by their HF names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weight files (kvpilot does not read .bin files; "
                             "convert them with save_pretrained(safe_serialization=True))")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors file ({exc})") from exc
    return state
