"""What requests spent before their prompt ran, where the server reports only its prompt's own time.

llama-server puts ``timings.prompt_ms`` on each response (bench: ``RequestRecord.server_prompt_ms``): from the
prompt's first batch to its last, without any wait before it. Client TTFT minus that *gap* is everything else:
the network path and HTTP handling, waiting for a slot, waiting for the running batch, and client delay. No
queue wait is reported, so the gap is read where one of its parts can be isolated:

* **At one request in flight** (the probe's baseline) with no request waiting for a slot (the server's waiting
  gauge stayed 0): nothing of the probe's own competes, so the quickest requests' gap (p10: a hop delays every
  request, another user's batch only some) is the path's own cost: the network-overhead rule reads it.
* **With several in flight**, uniform short prompts and still no request waiting for a slot, the gap should
  stay within a decode step of the one-request gap: a continuously batching server adds a new request to its
  next step. When it grows by several steps and most of the TTFT, new requests are held until the running
  batch finishes: static batching (llama-server ``--no-cont-batching``).

kvpilot's per-request stage timings and vLLM's TTFT histogram are read by the rules themselves; this module is
for servers that report neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.doctor.engines import LLAMACPP
from kvpilot.doctor.findings import Evidence, Finding, Fix, LatencyShare, Severity, clamp01
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.client_lag import run_client_lag
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.signals import median, quantile

SOURCE = "client TTFT - the server's timings.prompt_ms"
UNIFORM_DATASETS = ("random", "")
"""Runs whose prompts are all short and alike (the probe's baseline and ramp): a long prompt of the probe's own
(the long-short phase) holds the batch a step long, which is not a wait for the batch to finish."""


@dataclass(frozen=True)
class PromptGap:
    """One run's requests' client TTFT minus the server's prompt time (``gaps_ms``, ms, one per successful
    request that has both), next to their median client TTFT and TPOT."""

    run: RunData
    gaps_ms: tuple[float, ...]
    ttft_ms: float
    tpot_ms: float | None

    @property
    def median_ms(self) -> float:
        return median(self.gaps_ms) or 0.0

    @property
    def low_ms(self) -> float:
        """The quickest requests' gap (p10): what every request spent outside its prompt."""
        return quantile(self.gaps_ms, 0.1) or 0.0


def prompt_gap(run: RunData, min_requests: int) -> PromptGap | None:
    """The run's gaps, or None with fewer than ``min_requests`` requests that carry the server's prompt time."""
    pairs = [(r.ttft_ms, r.server_prompt_ms) for r in run.ok
             if r.ttft_ms is not None and r.server_prompt_ms is not None]
    if len(pairs) < min_requests:
        return None
    return PromptGap(run, tuple(c - s for c, s in pairs), median(c for c, _ in pairs) or 0.0,
                     median(r.tpot_ms for r in run.ok))


def nothing_waited(run: RunData) -> bool:
    """The server's waiting gauge (llama-server's ``requests_deferred``) stayed 0 over the run; False when it
    was not scraped."""
    waiting = (run.server_metrics or {}).get("waiting_max")
    return waiting is not None and float(waiting) <= 0.0


def _uniform(run: RunData) -> bool:
    return str(run.dataset.get("kind") or "") in UNIFORM_DATASETS


def one_in_flight_gap(ctx: RuleContext) -> PromptGap | None:
    """The gap of the lowest-load run at about one request in flight with nothing waiting for a slot (see the
    module docstring), or None."""
    runs = [r for r in ctx.inputs.runs if r.in_flight <= 1.5 and _uniform(r) and nothing_waited(r)]
    gaps = [g for r in runs if (g := prompt_gap(r, ctx.th.min_requests)) is not None]
    return min(gaps, key=lambda g: g.run.in_flight) if gaps else None


@dataclass(frozen=True)
class BatchWait:
    """At ``loaded``, requests waited ``extra_ms`` (median gap beyond the one-request run's) before their prompt
    ran, while no request waited for a slot."""

    base: PromptGap
    loaded: PromptGap
    extra_ms: float

    @property
    def share(self) -> float:
        return clamp01(self.extra_ms / self.loaded.ttft_ms) if self.loaded.ttft_ms > 0 else 0.0


def measure_batch_wait(ctx: RuleContext) -> BatchWait | None:
    """The loaded run whose requests waited longest for the running batch, when that wait is at least
    ``batch_wait_steps`` decode steps (its median TPOT), ``network_min_ms`` and ``batch_wait_share`` of its
    median TTFT, and the client's own stalls there (p99) under ``client_lag_share_most`` of it; None otherwise,
    or without a one-request run to compare with."""
    th, base = ctx.th, one_in_flight_gap(ctx)
    if base is None:
        return None
    best: BatchWait | None = None
    for run in ctx.inputs.runs:
        if run.in_flight < 2 or not _uniform(run) or not nothing_waited(run):
            continue
        loaded = prompt_gap(run, th.min_requests)
        if loaded is None or not loaded.tpot_ms:
            continue
        found = BatchWait(base, loaded, loaded.median_ms - base.median_ms)
        if found.extra_ms < max(th.network_min_ms, th.batch_wait_steps * loaded.tpot_ms) or \
                found.share < th.batch_wait_share:
            continue
        if run_client_lag(run).lag_ms >= th.client_lag_share_most * found.extra_ms:
            continue  # a stalled client reads the first chunk late by as much: the wait may be its own
        if best is None or found.share > best.share:
            best = found
    return best


def batch_wait(ctx: RuleContext) -> Finding | None:
    """Static batching seen in the requests' own times (module docstring); high."""
    wait = measure_batch_wait(ctx)
    if wait is None:
        return None
    run, tpot = wait.loaded.run, wait.loaded.tpot_ms or 0.0
    where = f"at {run.in_flight:.1f} in flight"
    return Finding(
        rule_id="static-batching", title="New requests wait for the running batch to finish",
        severity=Severity.HIGH, confidence=0.8, impact=wait.share,
        summary=(f"{where.capitalize()}, requests waited a median {wait.extra_ms:,.0f} ms more before their prompt ran "
                 f"than at one in flight ({wait.share:.0%} of their {wait.loaded.ttft_ms:,.0f} ms median TTFT, "
                 f"{wait.extra_ms / tpot:.0f} decode steps of {tpot:,.0f} ms), while no request waited for a slot: "
                 "the server starts new requests only when its running batch has finished (static batching), so "
                 "each waits for the longest answer in flight."),
        evidence=(Evidence(f"median wait before the prompt ran {where}", wait.loaded.median_ms, "ms", SOURCE),
                  Evidence(f"the same at {wait.base.run.in_flight:.1f} in flight", wait.base.median_ms, "ms", SOURCE),
                  Evidence("requests waiting for a slot at most", 0.0, "", "server metrics (waiting)"),
                  Evidence(f"median TPOT {where}", tpot, "ms", "client")),
        explains=LatencyShare(wait.extra_ms, wait.loaded.ttft_ms, f"median client TTFT {where}"),
        fixes=(Fix("turn continuous batching on, so a new request joins the running batch at its next step "
                   "(llama-server: drop --no-cont-batching; it is on by default)",
                   engine=LLAMACPP, engine_flags="--cont-batching"),))
