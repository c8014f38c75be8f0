"""The order findings are reported in: the same for the same server, probe after probe.

A finding's place follows, in this order:

1. its severity (how much the problem costs users);
2. whether it defers to another finding (a symptom whose cause was also found ranks below causes);
3. its share-of-latency band (``SHARE_BANDS``): how much of the measured latency it explains;
4. the order the rules run in (``RULES``: the host, the configuration, the measurement, then the
   request's path: the order a careful engineer checks them, causes before the stages they slow);
5. the rule id.

Why bands and not the raw score (confidence x impact): two shares a few percent apart are noise on a
busy machine, and ranking by them made the first finding change between probes of one server. Bands are
coarse (a cause explains little, part, or a large share of the time), so a finding changes band only when
its share changes several-fold; inside a band the rule order decides, which never changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.doctor.findings import Finding

SHARE_BANDS: tuple[float, ...] = (0.1, 0.3)
"""Upper edges of the "little" (< 10%) and "part" (10-30%) bands; 30% and above is "large". A high-severity
finding's share is in the large band for every rule that sets severity by share (cpu-starvation is high from
40% run-queue wait, queueing from 70% of TTFT), so among high findings the rule order decides."""


def share_band(share: float) -> int:
    """0 (little), 1 (part) or 2 (large): how many band edges ``share`` reaches."""
    return sum(1 for edge in SHARE_BANDS if share >= edge)


def rank(findings: Sequence[Finding]) -> tuple[Finding, ...]:
    """``findings`` in report order. Their input order is the rules' order (precedence, step 4 above):
    :func:`~kvpilot.doctor.diagnose.diagnose` passes them as the rules produced them. Deterministic: equal
    inputs give equal output, and no two findings compare equal (the index is unique)."""
    keyed = sorted(enumerate(findings), key=lambda item: (
        -item[1].severity.rank, bool(item[1].defers_to), -share_band(item[1].impact), item[0], item[1].rule_id))
    return tuple(f for _, f in keyed)
