"""The metric names and matcher labels a PromQL expression reads, for checking a dashboard against /metrics.

Not a PromQL parser: enough of the grammar for the dashboard's expressions. Strings are dropped first (label
values), then range selectors and grouping clauses (`by (...)`); what is left of each `{...}` gives the label
names matched on the selector before it; an identifier followed by `(` is a function, and keywords are
dropped; every other identifier is a metric name.
"""

from __future__ import annotations

import re

KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                      "bool", "offset"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring)\s*\([^)]*\)")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
_IDENTIFIER = re.compile(r"(?<![A-Za-z0-9_:.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_LABEL_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


def metric_labels(expr: str) -> dict[str, set[str]]:
    """Metric name -> the label names its selectors match on (empty when it has no `{...}`)."""
    text = _GROUPING.sub(" ", _RANGE.sub(" ", _STRING.sub('""', expr)))
    found: dict[str, set[str]] = {}
    for match in _SELECTOR.finditer(text):
        if match.group(1):
            found.setdefault(match.group(1), set()).update(_LABEL_NAME.findall(match.group(2)))
    text = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text)
    for match in _IDENTIFIER.finditer(text):
        name, call = match.group(1), match.group(2)
        if not call and name not in KEYWORDS:
            found.setdefault(name, set())
    return found


def label_values_metric(query: str) -> str | None:
    """The metric of a Grafana `label_values(metric, label)` variable query (None for other queries)."""
    match = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*\w+\s*\)\s*", query)
    return match.group(1) if match else None
