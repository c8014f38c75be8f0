"""The replicas' Prometheus text, merged: `/metrics` aggregated over replicas, `/metrics/replicas` every
replica's series labelled replica="<id>", lane="<lane>".

Aggregation: counters, histograms (buckets, sums, counts) and additive gauges are summed per label set;
ratio gauges (names ending `_perc`, `_ratio`, `_rate`, `_fraction`, `_utilization`) are averaged; info
metrics (`_info`) keep one copy per label set. So a dashboard or `kvpilot bench`/`doctor` reading the
aggregate sees one engine as large as all replicas, and per-replica views keep the detail.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

from prometheus_client.parser import text_string_to_metric_families

AVERAGED_SUFFIXES = ("_perc", "_ratio", "_rate", "_fraction", "_utilization")


@dataclass(frozen=True)
class ReplicaMetrics:
    """One replica's latest /metrics text, as it reported it."""

    replica_id: str
    lane: str
    text: str


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample_line(name: str, labels: Mapping[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value!r}" if inner else f"{name} {value!r}"


def _families(replicas: list[ReplicaMetrics]):  # type: ignore[no-untyped-def]
    """(replica, family) pairs, families in first-seen order."""
    for replica in replicas:
        for family in text_string_to_metric_families(replica.text):
            yield replica, family


def _header(name: str, documentation: str, kind: str) -> list[str]:
    """As prometheus_client writes it: a counter's family is named with its `_total` samples' name."""
    name = f"{name}_total" if kind == "counter" else name
    kind = {"unknown": "untyped"}.get(kind, kind)
    return [f"# HELP {name} {documentation}", f"# TYPE {name} {kind}"]


def per_replica_text(replicas: list[ReplicaMetrics]) -> str:
    """Every sample of every replica, with replica and lane labels, one HELP/TYPE per family."""
    headers: dict[str, list[str]] = {}
    lines: dict[str, list[str]] = defaultdict(list)
    for replica, family in _families(replicas):
        headers.setdefault(family.name, _header(family.name, family.documentation, family.type))
        for s in family.samples:
            labels = {**s.labels, "replica": replica.replica_id, "lane": replica.lane}
            lines[family.name].append(_sample_line(s.name, labels, s.value))
    return "".join("\n".join(headers[name] + lines[name]) + "\n" for name in headers)


def aggregate_text(replicas: list[ReplicaMetrics]) -> str:
    """One series per (sample name, label set) over all replicas; see the module docstring."""
    headers: dict[str, list[str]] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = defaultdict(dict)
    for _, family in _families(replicas):
        if family.name.endswith("_created"):
            continue  # creation times: no sum or mean of them means anything
        headers.setdefault(family.name, _header(family.name, family.documentation, family.type))
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            key = (s.name, tuple(sorted(s.labels.items())))
            sums[family.name].setdefault(key, []).append(s.value)
    out: list[str] = []
    for name, header in headers.items():
        out += header
        for (sample, labels), values in sums[name].items():
            out.append(_sample_line(sample, dict(labels), _combine(name, values)))
    return "\n".join(out) + "\n" if out else ""


def _combine(family: str, values: list[float]) -> float:
    if family.endswith("_info"):
        return values[0]
    if family.endswith(AVERAGED_SUFFIXES):
        return sum(values) / len(values)
    return sum(values)
