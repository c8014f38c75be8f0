"""``--sweep``: synchronous, then max throughput, then rates in between; find the saturation knee."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable

import numpy as np

from kvpilot.bench.load import LoadShape
from kvpilot.bench.result import Knee, RunResult

RunFn = Callable[[str, LoadShape], Awaitable[RunResult]]
SATURATION = 0.95


def sweep_rates(sync_rps: float, max_rps: float, num_between: int) -> list[float]:
    """``num_between`` request rates evenly spaced strictly between the two measured throughputs."""
    if num_between <= 0 or not (max_rps > sync_rps > 0):
        return []
    return [float(r) for r in np.linspace(sync_rps, max_rps, num_between + 2)[1:-1]]


def find_knee(runs: list[RunResult], slos: dict[str, float], goodput_target: float) -> Knee:
    """Runs must be in increasing load. With SLOs: the highest-load run whose fraction of requests
    meeting every SLO is >= ``goodput_target``. Without SLOs: the lowest-load run reaching
    95% of the best output-token throughput (where more load stops buying throughput)."""
    if not runs:
        return Knee(None, "no runs", goodput_target)
    if slos:
        good = [i for i, r in enumerate(runs) if (r.aggregates.good_fraction or 0.0) >= goodput_target]
        if not good:
            return Knee(None, f"no load met the SLOs for {goodput_target:.0%} of requests", goodput_target)
        i = good[-1]
        return Knee(i, f"highest load with >= {goodput_target:.0%} of requests within SLOs "
                       f"({runs[i].label})", goodput_target)
    tputs = [r.aggregates.output_token_throughput for r in runs]
    best = max(tputs)
    i = next(k for k, t in enumerate(tputs) if t >= SATURATION * best)
    return Knee(i, f"no SLOs given: lowest load reaching {SATURATION:.0%} of peak output throughput "
                   f"({runs[i].label})", goodput_target)


async def run_sweep(base: LoadShape, run: RunFn, num_points: int) -> list[RunResult]:
    """Run the sweep through ``run(label, shape)``; returns runs in increasing load order.

    ``num_points`` counts all runs (>= 2): synchronous, max throughput, and the rates between.
    """
    def open_loop(rate: float) -> LoadShape:
        return dataclasses.replace(base, concurrency=None, request_rate=rate)

    sync = await run("synchronous", dataclasses.replace(base, concurrency=1, max_concurrency=None))
    peak = await run("max-throughput", open_loop(math.inf))
    rates = sweep_rates(sync.aggregates.request_throughput, peak.aggregates.request_throughput,
                        max(0, num_points - 2))
    middle = [await run(f"rate={r:.3g}/s", open_loop(r)) for r in rates]
    return [sync, *middle, peak]
