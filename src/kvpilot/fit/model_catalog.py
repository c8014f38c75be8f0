"""Built-in catalog of popular models with their real Hugging Face config.json contents.

One catalog serves `kvpilot fit` and the model loader's dummy-weight configs. Parameter counts are
never stored here: `kvpilot.fit.params` derives them from these configs.
"""

from __future__ import annotations

import copy
from typing import Any

from kvpilot.fit.catalog import llama, openai, others, qwen
from kvpilot.fit.catalog.entry import CatalogEntry
from kvpilot.fit.errors import UnknownModelError, suggest

__all__ = ["UnknownModelError", "get_hf_config", "get_repo_id", "list_models"]

_ENTRIES: dict[str, CatalogEntry] = {**llama.CONFIGS, **qwen.CONFIGS, **others.CONFIGS, **openai.CONFIGS}


def _lookup_table() -> dict[str, str]:
    """Lowercased short names and HF repo ids -> canonical short name."""
    table: dict[str, str] = {}
    for short, entry in _ENTRIES.items():
        for key in (short, entry.repo_id, *entry.alias_ids):
            table[key.lower()] = short
    return table


_LOOKUP = _lookup_table()


def list_models() -> list[str]:
    """Canonical short names (lowercase), in catalog order."""
    return list(_ENTRIES)


def canonical_name(name: str) -> str:
    """Short name for a short name or HF repo id (case-insensitive); UnknownModelError otherwise."""
    short = _LOOKUP.get(name.strip().lower())
    if short is None:
        raise UnknownModelError(suggest(name, list_models(), "model"))
    return short


def get_hf_config(name: str) -> dict[str, Any]:
    """A deep copy of the model's real HF config.json dict (safe for the caller to mutate)."""
    return copy.deepcopy(_ENTRIES[canonical_name(name)].hf_config)


def get_repo_id(name: str) -> str:
    """The Hugging Face repo id the catalog's config was copied from."""
    return _ENTRIES[canonical_name(name)].repo_id
