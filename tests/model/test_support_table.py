"""Issue 45: docs/models.md's support table is the registry's, and the registry is self-consistent: every
family's model class imports and subclasses the shared decoder's interface, and names its architectures."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.model.models.registry import FAMILIES, family_for_architecture, supported_architectures
from kvpilot.model.models.support_table import replace_table, support_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_docs_table_matches_registry() -> None:
    text = DOC.read_text()
    assert support_table() in text, ("docs/models.md is out of date: run "
                                     "python -m kvpilot.model.models.support_table --write docs/models.md")
    assert replace_table(text) == text


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_family_class_loads(family) -> None:
    model_class = family.load_class()
    for method in ("forward", "logits", "load_weights", "hf_state_dict", "output_weight"):
        assert callable(getattr(model_class, method, None)), f"{family.name}: {model_class} lacks {method}"
    for arch in family.architectures:
        assert family_for_architecture(arch) is family and arch in supported_architectures()


def test_gguf_architectures_map_to_their_family() -> None:
    from kvpilot.fit.gguf_metadata import GGUF_ARCHITECTURES

    for family in FAMILIES:
        for gguf_arch in family.gguf_architectures:
            assert GGUF_ARCHITECTURES.get(gguf_arch) in family.architectures, (family.name, gguf_arch)
