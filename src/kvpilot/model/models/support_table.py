"""The support matrix of docs/models.md, generated from the registry so that it cannot drift from the code
(tests/model/test_support_table.py compares the two).

    python -m kvpilot.model.models.support_table                      # prints the table
    python -m kvpilot.model.models.support_table --write docs/models.md  # rewrites it between the markers
"""

from __future__ import annotations

from kvpilot.model.models.registry import ALL_BACKENDS, ALL_FORMATS, FAMILIES, ModelFamily

BEGIN, END = "<!-- support-table:begin -->", "<!-- support-table:end -->"
_YES, _NO = "yes", "-"


def _mark(on: bool) -> str:
    return _YES if on else _NO


def _row(family: ModelFamily) -> list[str]:
    gguf = "gguf" in family.formats
    packing = "packed" if family.packed_gguf else "experts packed" if family.packed_gguf_experts else "dequantized"
    gguf_cell = packing if gguf else _NO
    return [f"`{family.name}`", ", ".join(f"`{a}`" for a in family.architectures),
            ", ".join(f"`{a}`" for a in family.gguf_architectures) or _NO,
            *(_mark(b in family.attention_backends) for b in ALL_BACKENDS),
            _mark("safetensors" in family.formats), gguf_cell, _mark("dummy" in family.formats),
            _mark(family.tensor_parallel), _mark(family.fused_decode), family.notes or ""]


def support_table() -> str:
    """The markdown table: one row per family, in registry order."""
    header = ["family", "HF architectures", "GGUF", *(f"{b} attn" for b in ALL_BACKENDS),
              *ALL_FORMATS, "TP", "CPU fused decode", "notes"]
    header[3 + len(ALL_BACKENDS) + 1] = "GGUF weights"
    rows = [header, ["---"] * len(header), *(_row(f) for f in FAMILIES)]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in rows)


def replace_table(document: str) -> str:
    """`document` with the text between the BEGIN and END markers replaced by the current table."""
    head, _, rest = document.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{support_table()}\n{END}{tail}"


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if sys.argv[1:2] == ["--write"]:
        path = Path(sys.argv[2])
        path.write_text(replace_table(path.read_text()))
    else:
        print(support_table())
