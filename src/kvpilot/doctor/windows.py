"""A run's speed over time: output tokens per second in fixed windows, at the load each window carried.

Requests record when their tokens arrived (first token at ``sent + TTFT``, then one inter-token gap per
chunk), so a run can be cut into windows and each window's delivered tokens counted. Windows that carried
about the run's typical load (requests in flight) are comparable: a server that delivered 300 tok/s in one
such window and 30 in most others was not limited by its configuration (that is the same in every window)
but slowed by something else for most of the run: other processes, swap, throttling. That is the run's
"own best window": a limit this machine demonstrably reached, measured by the run itself.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from kvpilot.bench.records import RequestRecord
from kvpilot.doctor.signals import first_token_s

MIN_WINDOW_S = 2.0
"""Windows are at least this long: shorter ones count a handful of engine steps (on a CPU one step of a
long prefill alone can take a second) and their rates swing with step alignment."""

WINDOWS_PER_RUN = 12
"""A long run is cut into this many windows (each longer than MIN_WINDOW_S)."""

REQUEST_LIFETIMES_PER_WINDOW = 3
"""A window lasts at least this many lifetimes (median E2E) of the requests that made the best window's rate.
A server that prefills a whole batch of prompts before decoding them (llama.cpp without chunked prefill, short
outputs, a slow CPU) delivers its output tokens in bursts, one per cycle of its synchronized requests: windows
about one cycle long hold zero, one or two bursts, and a healthy server's typical window looked a third of its
best (the doctor matrix's llama-server cells). Three lifetimes hold three bursts, give or take one."""

LOAD_BAND = (2 / 3, 3 / 2)
"""Windows compared are those whose mean in-flight count lies within this factor of the median window's:
aggregate throughput grows with the batch, so only windows at about the same load are compared (the ramp-up
and drain of a closed loop, and the lulls of an open loop, are left out)."""


@dataclass(frozen=True)
class WindowSpeed:
    """One run's output throughput per window. ``typical`` is the median window among those at the run's
    typical load, ``best`` the fastest of them; ``tokens_best`` the tokens that window delivered.
    Invariant: ``typical <= best``; ``num_windows >= 1``."""

    window_s: float
    num_windows: int
    typical: float
    best: float
    tokens_best: float

    @property
    def typical_share(self) -> float:
        """typical / best: 1.0 for a steady server, low when it ran at its best only briefly."""
        return self.typical / self.best if self.best > 0 else 1.0


def _token_times(r: RequestRecord) -> list[tuple[float, float]]:
    """(arrival time on the run clock, tokens) per chunk; a chunk's share of the output is even."""
    t = first_token_s(r)
    if t is None:
        return []
    per_chunk = r.num_output_tokens / (len(r.itl_ms) + 1)
    out = [(t, per_chunk)]
    for gap in r.itl_ms:
        t += gap / 1000.0
        out.append((t, per_chunk))
    return out


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def window_speed(records: list[RequestRecord]) -> WindowSpeed | None:
    """The run's per-window throughput at its typical load; None when the run is too short for its windows
    (``MIN_WINDOW_S``, and ``REQUEST_LIFETIMES_PER_WINDOW`` lifetimes of the best window's requests) to be
    compared (fewer than four at the typical load)."""
    ok = [r for r in records if r.ok and r.e2e_ms is not None]
    if not ok:
        return None
    start = min(r.sent_s for r in ok)
    end = max(r.sent_s + r.e2e_ms / 1000.0 for r in ok)
    speed = _windows(ok, start, end, max(MIN_WINDOW_S, (end - start) / WINDOWS_PER_RUN))
    if speed is None:
        return None
    speed, lifetime_s = speed
    if REQUEST_LIFETIMES_PER_WINDOW * lifetime_s <= speed.window_s:
        return speed
    widened = _windows(ok, start, end, REQUEST_LIFETIMES_PER_WINDOW * lifetime_s)
    return None if widened is None else widened[0]


def _windows(records: list[RequestRecord], start: float, end: float,
             width: float) -> tuple[WindowSpeed, float] | None:
    """window_speed for windows of ``width`` seconds, with the median E2E (s) of the requests whose tokens made
    the best window; None for fewer than four windows at the typical load."""
    count = int((end - start) // width)
    if count < 4:
        return None
    edges = [start + i * width for i in range(count + 1)]
    spans = [(r.sent_s, r.sent_s + r.e2e_ms / 1000.0) for r in records]
    tokens = [0.0] * count
    makers: list[set[int]] = [set() for _ in range(count)]
    for k, r in enumerate(records):
        for t, n in _token_times(r):
            i = int((t - start) // width)
            if 0 <= i < count:
                tokens[i] += n
                makers[i].add(k)
    load = [sum(_overlap(edges[i], edges[i + 1], s, e) for s, e in spans) / width for i in range(count)]
    typical_load = statistics.median(load)
    lo, hi = LOAD_BAND
    kept = [i for i in range(count) if lo * typical_load <= load[i] <= hi * typical_load]
    if len(kept) < 4:
        return None
    rates = [tokens[i] / width for i in kept]
    best = max(kept, key=lambda i: tokens[i])
    lifetime_s = statistics.median(records[k].e2e_ms / 1000.0 for k in makers[best]) if makers[best] else 0.0
    return WindowSpeed(width, len(kept), statistics.median(rates), tokens[best] / width, tokens[best]), lifetime_s
