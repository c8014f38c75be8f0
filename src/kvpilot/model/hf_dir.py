"""Loads a Hugging Face model directory: config.json + *.safetensors (+ tokenizer files)."""

from __future__ import annotations

import json
from collections.abc import Callable
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


def load_safetensors_state_dict(directory: str | Path, index: Callable[[str], tuple[slice, ...] | None]
                                | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the directory's *.safetensors files (sharded or not), by their HF names. With `index`
    (a tensor-parallel rank's ShardPlan.index), only each tensor's part it names is read from the file."""
    from safetensors import SafetensorError

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weight files (kvpilot does not read .bin files; "
                             "convert them with save_pretrained(safe_serialization=True))")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(_read_safetensors(file, index))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors file ({exc})") from exc
    return state


def _read_safetensors(file: Path, index: Callable[[str], tuple[slice, ...] | None] | None,
                      ) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    if index is None:
        return load_file(str(file))
    tensors = {}
    with safe_open(str(file), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
            part = index(name)
            tensors[name] = handle.get_tensor(name) if part is None else handle.get_slice(name)[part]
    return tensors
