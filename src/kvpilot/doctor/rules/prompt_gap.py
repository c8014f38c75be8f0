"""What requests spent before their prompt ran, where the server reports only its prompt's own time.

llama-server puts ``timings.prompt_ms`` on each response (bench: ``RequestRecord.server_prompt_ms``): from the
prompt's first batch to its last, without any wait before it. Client TTFT minus that *gap* is everything else:
the network path and HTTP handling, waiting for a slot, waiting for the running batch, and client delay. No
queue wait is reported, so the gap is read where one of its parts can be isolated, over runs of short prompts
(the probe's baseline and ramp) during which the server's waiting gauge stayed 0 (no request waited for a slot):

* **The path's own cost**: the quickest requests' gap (p10 over those runs). A hop delays every request; a wait
  for the batch only some.
* **Static batching**: a continuously batching server adds a new request to its next step, so the mean gap stays
  within about one decode step (TPOT) of the path's cost. A server that starts new requests only when its running
  batch has finished (``--no-cont-batching``) makes each wait for the longest answer in flight: several steps
  (docs/doctor.md has the measurement). Outputs of one length hide it (the batch then finishes together), hence
  the probe's ramp varies them. The wait must also be a share of the TTFT: behind a slow hop the gap's jitter alone
  is a few steps, but a small part of the TTFT.

kvpilot's per-request stage timings and vLLM's TTFT histogram are read by the rules themselves; this module is
for servers that report neither.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from kvpilot.doctor.engines import LLAMACPP
from kvpilot.doctor.findings import Evidence, Finding, Fix, LatencyShare, Severity, clamp01
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.client_lag import run_client_lag
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.foreign_prefill import measure_foreign_prefill
from kvpilot.doctor.signals import median, quantile

SOURCE = "client TTFT - the server's timings.prompt_ms"
SHORT_PROMPT_DATASETS = ("random", "")
"""Runs of short prompts of one size class (the probe's baseline and ramp): a long prompt of the probe's own (the
long-short phase) holds a step long, which is not a wait for the batch to finish."""


def prompt_timed(run: RunData) -> list[tuple[float, float]]:
    """(client TTFT, the server's prompt time) of each successful request that has both."""
    return [(r.ttft_ms, r.server_prompt_ms) for r in run.ok if r.ttft_ms is not None and r.server_prompt_ms is not None]


def gaps_ms(run: RunData) -> list[float]:
    """Client TTFT minus the server's prompt time, per successful request that has both."""
    return [ttft - prompt for ttft, prompt in prompt_timed(run)]


def nothing_waited(run: RunData) -> bool:
    """The server's waiting gauge (llama-server's ``requests_deferred``) stayed 0 over the run; False when it
    was not scraped."""
    waiting = (run.server_metrics or {}).get("waiting_max")
    return waiting is not None and float(waiting) <= 0.0


def readable(run: RunData) -> bool:
    """A run whose gaps the module reads: short prompts, nothing waiting for a slot."""
    return str(run.dataset.get("kind") or "") in SHORT_PROMPT_DATASETS and nothing_waited(run)


@dataclass(frozen=True)
class PathGap:
    """The gaps of every readable run, pooled, next to those requests' median client TTFT."""

    gaps_ms: tuple[float, ...]
    ttft_ms: float

    @property
    def low_ms(self) -> float:
        """The quickest requests' gap (p10): what every request spent outside its prompt, the path's cost."""
        return quantile(self.gaps_ms, 0.1) or 0.0

    @property
    def median_ms(self) -> float:
        return median(self.gaps_ms) or 0.0


def path_gap(ctx: RuleContext) -> PathGap | None:
    """The pooled gaps of the readable runs, or None with fewer than ``min_requests`` of them."""
    pairs = [p for run in ctx.inputs.runs if readable(run) for p in prompt_timed(run)]
    if len(pairs) < ctx.th.min_requests:
        return None
    return PathGap(tuple(ttft - prompt for ttft, prompt in pairs), median(ttft for ttft, _ in pairs) or 0.0)


@dataclass(frozen=True)
class BatchWait:
    """In ``run``, requests waited ``extra_ms`` on average beyond the path's cost before their prompt ran (mean
    gap ``mean_ms``, path ``path_ms``), ``steps`` decode steps of ``tpot_ms``; ``ttft_ms``: their mean TTFT."""

    run: RunData
    mean_ms: float
    path_ms: float
    tpot_ms: float
    ttft_ms: float

    @property
    def extra_ms(self) -> float:
        return self.mean_ms - self.path_ms

    @property
    def steps(self) -> float:
        return self.extra_ms / self.tpot_ms if self.tpot_ms > 0 else 0.0

    @property
    def share(self) -> float:
        return clamp01(self.extra_ms / self.ttft_ms) if self.ttft_ms > 0 else 0.0


def measure_batch_wait(ctx: RuleContext) -> BatchWait | None:
    """The readable run of at least two in flight whose requests waited the most decode steps beyond the path's
    cost, when that is at least ``batch_wait_steps`` steps, ``network_min_ms`` and ``batch_wait_min_share`` of their
    mean TTFT (a slow hop's jitter is a few percent of it), and the client's own stalls
    there (p99) are under ``client_lag_share_most`` of it; None otherwise, and when other users' long prompts were
    prefilled meanwhile (a request then waits for their step: foreign_prefill.py)."""
    th, path = ctx.th, path_gap(ctx)
    if path is None or measure_foreign_prefill(ctx) is not None:
        return None
    best: BatchWait | None = None
    for run in ctx.inputs.runs:
        gaps, tpot = gaps_ms(run), median(r.tpot_ms for r in run.ok)
        if run.in_flight < 2 or not readable(run) or len(gaps) < th.min_requests or not tpot:
            continue
        ttft = statistics.fmean(ttft for ttft, _ in prompt_timed(run))
        found = BatchWait(run, statistics.fmean(gaps), path.low_ms, tpot, ttft)
        if found.steps < th.batch_wait_steps or found.extra_ms < th.network_min_ms or \
                found.share < th.batch_wait_min_share:
            continue
        if run_client_lag(run).lag_ms >= th.client_lag_share_most * found.extra_ms:
            continue  # a stalled client reads the first chunk late by as much: the wait may be its own
        if best is None or found.steps > best.steps:
            best = found
    return best


def batch_wait(ctx: RuleContext) -> Finding | None:
    """Static batching seen in the requests' own times (module docstring); high when the wait is
    ``batch_wait_share`` of the TTFT, else medium."""
    wait = measure_batch_wait(ctx)
    if wait is None:
        return None
    where = f"at {wait.run.in_flight:.1f} in flight"
    return Finding(
        rule_id="static-batching", title="New requests wait for the running batch to finish",
        severity=Severity.HIGH if wait.share >= ctx.th.batch_wait_share else Severity.MEDIUM,
        confidence=0.8, impact=wait.share,
        summary=(f"{where[0].upper() + where[1:]}, requests waited {wait.extra_ms:,.0f} ms on average before their "
                 f"prompt ran, beyond the path's {wait.path_ms:,.0f} ms ({wait.steps:.1f} decode steps of "
                 f"{wait.tpot_ms:,.0f} ms; {wait.share:.0%} of their mean TTFT), while no request waited for a slot: "
                 "the server starts new requests only when its running batch has finished (static batching), so "
                 "each waits for the longest answer in flight, and their prompts then run all at once."),
        evidence=(Evidence(f"mean wait before the prompt ran {where}", wait.mean_ms, "ms", SOURCE),
                  Evidence("the path's own (p10 of the same, nothing waiting for a slot)", wait.path_ms, "ms", SOURCE),
                  Evidence("that wait in decode steps (median TPOT)", wait.steps, "x", "client"),
                  Evidence("requests waiting for a slot at most", 0.0, "", "server metrics (waiting)")),
        explains=LatencyShare(wait.extra_ms, wait.ttft_ms, f"mean client TTFT {where}"),
        fixes=(Fix("turn continuous batching on, so a new request joins the running batch at its next step "
                   "(llama-server: drop --no-cont-batching; it is on by default)",
                   engine=LLAMACPP, engine_flags="--cont-batching"),))
