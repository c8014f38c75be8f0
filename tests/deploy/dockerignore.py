"""Which paths a .dockerignore keeps out of the build context, by Docker's rules (its patternmatcher):

* patterns are relative to the context root (a leading `/` is dropped), `*` and `?` never cross `/`,
  `**` matches any number of directories (zero included);
* a pattern that matches a directory matches everything under it;
* `!pattern` re-includes, and the last pattern that matches a path decides.

Only what the tests need: no escapes (`\\*`), which the project's .dockerignore does not use.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path


def read_patterns(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _match_parts(pattern: list[str], parts: list[str]) -> bool:
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match_parts(rest, parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], head) and _match_parts(rest, parts[1:])


def _matches(pattern: str, path: str) -> bool:
    """The pattern matches the path or one of its parent directories."""
    pattern_parts = [p for p in pattern.strip("/").split("/") if p and p != "."]
    parts = path.split("/")
    return any(_match_parts(pattern_parts, parts[:n]) for n in range(1, len(parts) + 1))


def is_excluded(patterns: list[str], path: str) -> bool:
    """Whether `path` (relative to the context root, `/`-separated) stays out of the build context."""
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        if _matches(pattern[1:] if negated else pattern, path):
            excluded = not negated
    return excluded
