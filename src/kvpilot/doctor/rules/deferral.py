"""Step-time symptoms defer to host-level causes that explain them (swap, CPU starvation)."""

from __future__ import annotations

from kvpilot.doctor.findings import Finding
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.spillover import defer_to_swap
from kvpilot.doctor.rules.starvation import defer_to_starvation


def defer_to_host(ctx: RuleContext, finding: Finding) -> Finding:
    """:func:`defer_to_swap` then :func:`defer_to_starvation`: each lowers the confidence (and says
    why) only when its cause holds."""
    return defer_to_starvation(ctx, defer_to_swap(ctx, finding))
