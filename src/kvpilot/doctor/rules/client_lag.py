"""The load generator's own lag, per run: how late it sent requests and how long its event loop stalled, next to
the latency it measured. Read by the client rules, by rules that must not mistake a client stall for a server
delay, and by the live probe (which measures a phase again when its own loop stalled)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.bench.clientlag import stalled_lag_ms
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.signals import median, ratio
from kvpilot.doctor.thresholds import Thresholds


def _p99(dist: object) -> float:
    return float((dist or {}).get("p99") or 0.0) if isinstance(dist, dict) else 0.0


def _loop_lag_ms(lag: dict) -> float:
    """The run's event-loop lag: the per-tick p99 or, when larger, the stalls that cover 5% of the run's time (rare
    long stalls, which a per-tick p99 hides; recomputed from the samples for result files that predate it)."""
    samples = lag.get("loop_lag_samples") or []
    return max(_p99(lag.get("loop_lag_ms")), float(lag.get("loop_stall_ms") or 0.0), stalled_lag_ms(samples))


def stall_duty(client_lag: dict | None) -> float:
    """Share of a run's time its event loop was stalled: the late time of bench's loop-lag samples (one per
    10 ms tick, evenly thinned on long runs) over the time they span (0 without samples)."""
    lags = [float(s[1]) for s in (client_lag or {}).get("loop_lag_samples") or () if len(s) == 2]
    late = sum(lags)
    return late / (late + 10.0 * len(lags)) if lags else 0.0


def starved_share(client_lag: dict | None) -> float | None:
    """Share of a run's loop lateness its thread spent waiting for a CPU (runnable while other processes held
    the cores: bench's ``loop_run_delay_ms`` over ``loop_late_ms``), capped at 1; None where the bench could not
    read it or the loop was never late."""
    lag = client_lag or {}
    waited, late = lag.get("loop_run_delay_ms"), float(lag.get("loop_late_ms") or 0.0)
    return None if waited is None or late <= 0.0 else min(1.0, max(0.0, float(waited) / late))


@dataclass(frozen=True)
class RunClientLag:
    """The load generator's lag in one run, next to the latency it measured there.

    ``ttft_ms`` is the run's median client TTFT: the latency a client stall shifts by its whole length (the
    bytes wait in the socket until the loop reads them). TPOT is not the yardstick: a stall lands in one gap
    of many, so it moves TPOT by lag / (tokens - 1), and judging a 20 ms stall against a 5 ms TPOT blamed the
    client for a server whose requests waited seconds."""

    dispatch_ms: float
    loop_ms: float
    label: str
    ttft_ms: float | None
    closed_loop: bool
    stall_duty: float = 0.0  # the share of the run's time its event loop was stalled (stall_duty)
    starved_share: float | None = None  # of that lateness, the share spent waiting for a CPU (starved_share)

    @property
    def lag_ms(self) -> float:
        return max(self.dispatch_ms, self.loop_ms)

    @property
    def share(self) -> float | None:
        """p99 lag / median TTFT of the run, capped at 1 (None without a TTFT)."""
        share = ratio(self.lag_ms, self.ttft_ms)
        return min(1.0, share) if share is not None else None


def run_client_lag(run: RunData) -> RunClientLag:
    """One run's client lag next to its median client TTFT."""
    lag = run.client_lag or {}
    return RunClientLag(_p99(lag.get("dispatch_lag_ms")), _loop_lag_ms(lag), run.label,
                        median(r.ttft_ms for r in run.ok), run.closed_loop, stall_duty(lag), starved_share(lag))


def lag_counts(found: RunClientLag, th: Thresholds) -> bool:
    """Whether a run's client lag matters: its p99 exceeds ``max_client_lag_ms`` and is at least
    ``client_lag_share_of_latency`` of the run's median TTFT (milliseconds do not taint second-long latencies)."""
    share = found.share
    return found.lag_ms > th.max_client_lag_ms and (share is None or share >= th.client_lag_share_of_latency)


def lag_is_most(found: RunClientLag, th: Thresholds) -> bool:
    """Whether a run's client lag is most of its median TTFT: what makes client-overload a high finding."""
    return lag_counts(found, th) and (found.share is None or found.share >= th.client_lag_share_most)


def worst_client_lag(ctx: RuleContext) -> RunClientLag | None:
    """The run whose client lagged the most next to its median TTFT (:func:`lag_counts`), or None."""
    worst: RunClientLag | None = None
    for run in ctx.inputs.runs:
        found = run_client_lag(run)
        if not lag_counts(found, ctx.th):
            continue
        if worst is None or (found.share or 0.0) > (worst.share or 0.0):
            worst = found
    return worst
