"""Resolve the model argument of `kvpilot fit`: a catalog name or HF repo id, a config.json (file or
directory), or a GGUF file."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpilot.fit.errors import ConfigError
from kvpilot.fit.gguf_metadata import hf_config_from_reader, open_gguf
from kvpilot.fit.gguf_sizes import GgufSizes, gguf_sizes
from kvpilot.fit.model_catalog import canonical_name, get_hf_config, get_repo_id
from kvpilot.fit.model_spec import ModelSpec, spec_from_hf_config
from kvpilot.fit.params import ParamCounts, count_params
from kvpilot.fit.runtime_spec import runtime_spec_from_hf_config


@dataclass(frozen=True)
class LoadedModel:
    """A model as the planner sees it. Invariant: `gguf` is set only for GGUF sources, and then
    its tensor sizes are the weights' exact storage."""

    spec: ModelSpec
    params: ParamCounts
    source: str
    gguf: GgufSizes | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # as read

    @property
    def context_length(self) -> int:
        """The longest request the model supports: max_position_embeddings, stretched by the RoPE scaling
        where the config states the pre-scaling length (as the engine's ModelConfig does)."""
        scaling = runtime_spec_from_hf_config(self.hf_config, self.spec.name).rope_scaling if self.hf_config \
            else None
        return scaling.context_length(self.spec.max_position_embeddings, self.spec.model_type) if scaling else \
            self.spec.max_position_embeddings


def _from_config(config: dict[str, Any], name: str, source: str) -> LoadedModel:
    spec = spec_from_hf_config(config, name)
    return LoadedModel(spec=spec, params=count_params(spec), source=source, hf_config=config)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable JSON config ({exc}).") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a config.json must hold a JSON object.")
    return config


def _from_gguf(path: Path) -> LoadedModel:
    """Raises GgufError (a ConfigError) for an unreadable file or header."""
    reader = open_gguf(path)
    config = hf_config_from_reader(reader, path)
    loaded = _from_config(config, path.stem, f"GGUF file {path}")
    return LoadedModel(loaded.spec, loaded.params, loaded.source, gguf_sizes(reader), config)


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def load_model(arg: str) -> LoadedModel:
    """Catalog name / repo id, config.json file, directory holding config.json, or GGUF file.

    Raises UnknownModelError (with close matches) or ConfigError (unreadable or malformed file).
    """
    path = Path(arg).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path}: directory has no config.json; pass a config.json or GGUF file.")
        path = path / "config.json"
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _is_gguf(path):
            return _from_gguf(path)
        return _from_config(_read_json(path), path.parent.name or path.stem, f"config file {path}")
    if path.suffix.lower() in (".json", ".gguf"):
        raise ConfigError(f"{path}: no such file.")
    short = canonical_name(arg)
    return _from_config(get_hf_config(short), short, f"catalog: {get_repo_id(short)}")
