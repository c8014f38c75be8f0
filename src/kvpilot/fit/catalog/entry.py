"""The catalog's record type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CatalogEntry:
    """One model: its Hugging Face repo id, other accepted ids, and its real config.json.

    Invariant: `hf_config` is the verbatim content of `repo_id`'s config.json (minus keys that
    only matter to other tools, such as `transformers.js_config`), so it loads as a real HF config.
    """

    repo_id: str
    hf_config: dict[str, Any]
    alias_ids: tuple[str, ...] = field(default_factory=tuple)
