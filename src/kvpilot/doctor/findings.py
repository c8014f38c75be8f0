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
    (empty when that engine has no such flag). ``engine_flags``: the same change as flags of the engine that
    runs when it is another one (``engine``: SGLang, llama.cpp, TGI; kvpilot.doctor.engine_flags), "" when it
    has no counterpart or the engine is kvpilot, vLLM or unknown."""

    action: str
    kvpilot: str = ""
    vllm: str = ""
    engine: str = ""
    engine_flags: str = ""


@dataclass(frozen=True)
class LatencyShare:
    """How much of a measured latency a cause explains: ``part_ms`` of ``whole_ms``, the median ``of``
    (e.g. "client TTFT at 7.8 in flight"). Invariant: ``0 <= part_ms``, ``0 < whole_ms``."""

    part_ms: float
    whole_ms: float
    of: str

    @property
    def share(self) -> float:
        return clamp01(self.part_ms / self.whole_ms) if self.whole_ms > 0 else 0.0

    def text(self) -> str:
        return f"{self.share:.0%} of {self.of} ({self.part_ms:,.0f} of {self.whole_ms:,.0f} ms)"


@dataclass(frozen=True)
class Finding:
    """One diagnosed cause.

    Invariants: ``0 <= confidence <= 1``; ``0 <= impact <= 1`` is the share of user-visible latency
    (or throughput) the cause explains, used to rank findings of equal severity; ``explains``, when the
    rule measured it in milliseconds, is that share with its numbers (``impact`` then equals its share), else
    ``impact_basis`` says what the estimate is a share of;
    ``evidence`` holds the numbers the rule compared with its thresholds; ``defers_to`` names the finding
    that explains this one's symptom (this one then ranks below it and says so), "" when none; ``judged_by``
    names the measure a ``--verify`` trial of its fix is judged by when it is not the rule's usual one
    (verify.JUDGED_BY's keys), "" otherwise.
    """

    rule_id: str
    title: str
    severity: Severity
    confidence: float
    impact: float
    summary: str
    evidence: tuple[Evidence, ...]
    fixes: tuple[Fix, ...] = field(default=())
    explains: LatencyShare | None = None
    defers_to: str = ""
    impact_basis: str = ""  # what ``impact`` is a share of when no stage timing measures it ("" : unstated)
    judged_by: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.confidence <= 1.0 or not 0.0 <= self.impact <= 1.0:
            raise ValueError(f"{self.rule_id}: confidence and impact must be in [0, 1]")

    @property
    def score(self) -> float:
        """How sure times how much it matters (reported; ranking uses coarser bands, see ranking.py)."""
        return self.confidence * (0.5 + self.impact)

    @property
    def share_text(self) -> str:
        """The share of latency this cause explains, as printed with the finding."""
        if self.explains is not None:
            return "explains " + self.explains.text()
        basis = self.impact_basis or "estimated: no stage timing measures it"
        return f"explains ~{self.impact:.0%} ({basis})"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = self.severity.value
        d["share_of_latency"] = self.share_text
        return d


def clamp01(x: float) -> float:
    return max(0.0, min(1.0, x))
