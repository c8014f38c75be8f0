"""docs/architecture.md stays true to the code: every module file it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_the_architecture_doc_names_exists() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"(?<![\w.-])((?:[\w-]+/)*[\w-]+\.py)\b", text))
    files = [p.relative_to(ROOT).as_posix() for folder in ("src", "tests", "benchmarks", "scripts")
             for p in (ROOT / folder).rglob("*.py")]
    missing = sorted(name for name in named if not any(f == name or f.endswith("/" + name) for f in files))
    assert len(named) > 50  # the doc names the modules it describes
    assert missing == [], f"docs/architecture.md names modules that do not exist: {missing}"
