"""Rules about the measurement path: the load generator itself, and the network/gateway hop."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.bench.clientlag import stalled_lag_ms
from kvpilot.doctor.findings import Evidence, Finding, Fix, LatencyShare, Severity, clamp01
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.starvation import defer_to_starvation
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


SERVER_HISTOGRAM = "the server's TTFT histogram"


@dataclass(frozen=True)
class ClientAddedTtft:
    """The time to first token the client saw that the server did not (means over the same requests): what a
    stall of the load generator (or the network) added to the measured TTFT. ``source`` names where the
    server's side came from."""

    added_ms: float
    client_ms: float
    source: str

    @property
    def share(self) -> float:
        return min(1.0, max(0.0, self.added_ms / self.client_ms)) if self.client_ms > 0 else 0.0


def client_added_ttft(ctx: RuleContext) -> ClientAddedTtft | None:
    """Client mean TTFT minus the server's: kvpilot's per-request timings where the responses carry them, else
    the server's TTFT histogram over the same interval (vLLM's and SGLang's ``time_to_first_token_seconds``,
    the probe's before/after delta); None when neither side is known for at least ``min_requests``."""
    pairs = [(r.ttft_ms, r.server.ttft_ms) for run in ctx.inputs.runs for r in run.with_server
             if r.ttft_ms is not None and r.server is not None and r.server.ttft_ms is not None]
    if len(pairs) >= ctx.th.min_requests:
        client = sum(c for c, _ in pairs) / len(pairs)
        return ClientAddedTtft(client - sum(s for _, s in pairs) / len(pairs), client, "kvpilot server timings")
    snap, ok = ctx.inputs.metrics, [r for r in ctx.inputs.ok_records if r.ttft_ms is not None]
    server = snap.mean_ms("ttft") if snap is not None else None
    if server is None or len(ok) < ctx.th.min_requests:
        return None
    client = sum(r.ttft_ms or 0.0 for r in ok) / len(ok)
    return ClientAddedTtft(client - server, client, SERVER_HISTOGRAM)


def _client_fixes(closed_loop: bool) -> tuple[Fix, ...]:
    """Fixes that fit the run: a closed loop has no request rate to lower, only clients per process."""
    spread = Fix("run the load generator on its own cores or machine (not beside the server)",
                 kvpilot="kvpilot bench --base-url http://<server-host>:8000 (from another host)",
                 vllm="vllm bench serve --base-url http://<server-host>:8000 (from another host)")
    if closed_loop:
        return (Fix("split the clients over several bench processes (each runs its share of the loop)",
                    kvpilot="kvpilot bench --concurrency <current> --client-processes 4",
                    vllm="vllm bench serve --max-concurrency <half> (x2 processes)"), spread)
    return (Fix("lower the request rate per bench process and run several processes (or machines)",
                kvpilot="kvpilot bench --request-rate <current> --client-processes 4",
                vllm="vllm bench serve --request-rate <half> (x2 processes)"),
            Fix("cap requests in flight per client", kvpilot="kvpilot bench --max-concurrency <current in flight>",
                vllm="vllm bench serve --max-concurrency <current in flight>"), spread)


def client_overload(ctx: RuleContext) -> Finding | None:
    """The load generator lagged by an amount that matters next to what it measured (it taints the
    rest). High when the lag is most (``client_lag_share_most``) of its run's TTFT. The report then judges it
    against the delay the other findings diagnose (kvpilot.doctor.attribution: a caveat when it explains
    little of that, or when the client shares the server's machine and explains less than most). Defers to
    cpu-starvation when the host starved the server too (the client lags for the same reason)."""
    worst = worst_client_lag(ctx)
    if worst is None:
        return None
    th, share = ctx.th, worst.share
    evidence = [Evidence("p99 dispatch lag", worst.dispatch_ms, "ms", "client"),
                Evidence("event-loop lag (p99 of ticks, or stalls over 5% of the time)", worst.loop_ms, "ms",
                         "client"),
                Evidence("lag limit", th.max_client_lag_ms, "ms"),
                Evidence("event loop stalled (share of the run's time)", worst.stall_duty, "%", "client")]
    if worst.starved_share is not None:
        evidence.append(Evidence("of that, waiting for a CPU (other processes held the cores)", worst.starved_share,
                                 "%", "client /proc schedstat"))
    if share is not None and worst.ttft_ms is not None:
        evidence += [Evidence(f"median TTFT in run '{worst.label}'", worst.ttft_ms, "ms", "client"),
                     Evidence("lag / median TTFT", share, "%", "client")]
    added = client_added_ttft(ctx)
    if added is not None:
        evidence += [Evidence("client mean TTFT - server mean TTFT", added.added_ms, "ms", added.source),
                     Evidence("share of client mean TTFT", added.share, "%", added.source)]
    return defer_to_starvation(ctx, Finding(
        rule_id="client-overload", title="The load generator could not keep up",
        severity=Severity.HIGH if share is None or share >= th.client_lag_share_most else Severity.MEDIUM,
        confidence=0.9 if (share or 1.0) >= th.client_lag_share_most else 0.7,
        impact=share if share is not None else 0.5,
        summary=(f"In run '{worst.label}' the client sent requests up to {worst.dispatch_ms:.0f} ms late and its "
                 f"event loop stalled {worst.loop_ms:.0f} ms (p99, or stalls over 5% of the time"
                 + (f"; {share:.0%} of its median TTFT" if share is not None else "") + "): measured latencies include client delay, so read the other findings with care."),
        evidence=tuple(evidence), fixes=_client_fixes(worst.closed_loop),
        explains=LatencyShare(worst.lag_ms, worst.ttft_ms, f"client TTFT in run '{worst.label}'")
        if worst.ttft_ms else None))


def network_overhead(ctx: RuleContext) -> Finding | None:
    """Client TTFT well above the server's own TTFT: a proxy, gateway or long network path."""
    th = ctx.th
    pairs = [(r.ttft_ms, r.server.ttft_ms) for run in ctx.inputs.runs for r in run.with_server
             if r.ttft_ms is not None and r.server is not None]
    source, confidence = "kvpilot server timings", 0.9
    if len(pairs) >= th.min_requests:
        gap, client_ttft = median(c - s for c, s in pairs), median(c for c, _ in pairs)
        server_ttft = median(s for _, s in pairs)
    else:  # vLLM: client mean TTFT against the server's TTFT histogram mean (same requests only if
        # the metrics file was scraped around the run, hence the lower confidence)
        snap = ctx.inputs.metrics
        ok = ctx.inputs.ok_records
        server_ttft = snap.mean_ms("ttft") if snap is not None else None
        client_ttft = sum(r.ttft_ms or 0.0 for r in ok) / len(ok) if len(ok) >= th.min_requests else None
        if server_ttft is None or client_ttft is None:
            return None
        gap, source, confidence = client_ttft - server_ttft, "client mean vs vllm:time_to_first_token_seconds", 0.5
    share = ratio(gap, client_ttft)
    if gap is None or share is None or gap < th.network_min_ms or share < th.network_share_of_ttft:
        return None
    # A lagging load generator reads every chunk late: that delay lands in the same client - server gap, so
    # a gap the lag could fill cannot be pinned on the network; defer to client-overload (medium, half the
    # confidence). A lag far smaller than the gap explains little of it.
    lag = worst_client_lag(ctx)
    client_lagged = lag is not None and lag.lag_ms >= ctx.th.client_lag_share_most * gap
    severity = Severity.HIGH if share >= 0.5 and not client_lagged else Severity.MEDIUM
    return Finding(
        rule_id="network-overhead", title="Network or gateway adds most of the time to first token",
        severity=severity, confidence=confidence * (0.5 if client_lagged else 1.0),
        impact=clamp01(share),
        summary=(f"Clients see the first token {gap:.0f} ms later than the server sends it "
                 f"({share:.0%} of client TTFT): the time is spent between client and server, not in the engine"
                 + (" (or in the load generator, which lagged: fix that first and measure again)."
                    if client_lagged else ".")),
        evidence=(Evidence("median client TTFT - server TTFT", gap, "ms", source),
                  Evidence("median client TTFT", client_ttft or 0.0, "ms", "client"),
                  Evidence("median server TTFT", server_ttft or 0.0, "ms", source),
                  Evidence("share of client TTFT", share, "%")),
        explains=LatencyShare(gap, client_ttft, "client TTFT") if client_ttft else None,
        defers_to="client-overload" if client_lagged else "",
        fixes=(Fix("measure once directly against the server to confirm the hop is the cost",
                   kvpilot="kvpilot bench --base-url http://<server-host>:8000",
                   vllm="vllm bench serve --base-url http://<server-host>:8000"),
               Fix("stop the proxy from buffering streamed responses (SSE)",
                   kvpilot="nginx: proxy_buffering off; (or X-Accel-Buffering: no)",
                   vllm="nginx: proxy_buffering off; (or X-Accel-Buffering: no)"),
               Fix("place clients, gateway and server in one region / zone; reuse connections (keep-alive)")))
