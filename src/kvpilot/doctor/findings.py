"""The doctor's output contract: findings with evidence, confidence and fixes for kvpilot and vLLM."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Severity(StrEnum):
    """How much the problem costs users; ranks findings before confidence does."""

    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"

    @property
    def rank(self) -> int:
        return {"high": 3, "medium": 2, "low": 1}[self.value]


@dataclass(frozen=True)
class Evidence:
    """One number behind a finding: ``value`` in ``unit`` ("ms", "%", "x", "" for counts)."""

    name: str
    value: float
    unit: str = ""
    source: str = ""  # where it came from: "server timings", "client", "vllm:kv_cache_usage_perc", ...

    def text(self) -> str:
        value = f"{self.value * 100:.0f}%" if self.unit == "%" else f"{self.value:,.3g}{self.unit and ' ' + self.unit}"
        return f"{self.name}: {value}" + (f" ({self.source})" if self.source else "")


@dataclass(frozen=True)
class Fix:
    """One concrete change: what to do, and the flags for a kvpilot and a vLLM deployment
    (empty when that engine has no such flag)."""

    action: str
    kvpilot: str = ""
    vllm: str = ""


@dataclass(frozen=True)
class Finding:
    """One diagnosed cause.

    Invariants: ``0 <= confidence <= 1``; ``0 <= impact <= 1`` is the share of user-visible latency
    (or throughput) the cause explains, used to rank findings of equal severity; ``evidence`` holds
    the numbers the rule compared with its thresholds.
    """

    rule_id: str
    title: str
    severity: Severity
    confidence: float
    impact: float
    summary: str
    evidence: tuple[Evidence, ...]
    fixes: tuple[Fix, ...] = field(default=())

    def __post_init__(self) -> None:
        if not 0.0 <= self.confidence <= 1.0 or not 0.0 <= self.impact <= 1.0:
            raise ValueError(f"{self.rule_id}: confidence and impact must be in [0, 1]")

    @property
    def score(self) -> float:
        """Ranking key within a severity: how sure times how much it matters."""
        return self.confidence * (0.5 + self.impact)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = self.severity.value
        return d


def clamp01(x: float) -> float:
    return max(0.0, min(1.0, x))
