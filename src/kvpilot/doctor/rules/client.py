"""Rules about the measurement path: the load generator itself, and the network/gateway hop."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.doctor.findings import Evidence, Finding, Fix, LatencyShare, Severity, clamp01
from kvpilot.doctor.rules.client_lag import worst_client_lag
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.prompt_gap import SOURCE as PROMPT_GAP
from kvpilot.doctor.rules.prompt_gap import path_gap
from kvpilot.doctor.rules.starvation import defer_to_starvation
from kvpilot.doctor.signals import median, ratio

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


@dataclass(frozen=True)
class TtftGap:
    """Client TTFT beyond the server's (``gap_ms``), both sides, where the server's side came from, and how far the
    pairing of the two can be trusted."""

    gap_ms: float
    client_ms: float
    server_ms: float
    source: str
    confidence: float


def _ttft_gap(ctx: RuleContext) -> TtftGap | None:
    """The client-server TTFT gap: medians of kvpilot's per-request timings; else means against the server's TTFT
    histogram over the same interval (client_added_ttft; the same requests only if it was scraped around the run,
    hence the lower confidence); else llama-server's prompt time plus the quickest requests' time outside their prompt
    (rules/prompt_gap.py). None without any of them."""
    pairs = [(r.ttft_ms, r.server.ttft_ms) for run in ctx.inputs.runs for r in run.with_server
             if r.ttft_ms is not None and r.server is not None]
    if len(pairs) >= ctx.th.min_requests:
        return TtftGap(median(c - s for c, s in pairs) or 0.0, median(c for c, _ in pairs) or 0.0,
                       median(s for _, s in pairs) or 0.0, "kvpilot server timings", 0.9)
    added = client_added_ttft(ctx)
    if added is not None and added.source == SERVER_HISTOGRAM:
        return TtftGap(added.added_ms, added.client_ms, added.client_ms - added.added_ms,
                       "client mean vs the server's TTFT histogram (vllm:time_to_first_token_seconds)", 0.5)
    path = path_gap(ctx)
    if path is not None:
        return TtftGap(path.low_ms, path.ttft_ms, path.ttft_ms - path.low_ms,
                       f"p10 of {PROMPT_GAP}, nothing waiting for a slot", 0.7)
    return None


def network_overhead(ctx: RuleContext) -> Finding | None:
    """Client TTFT well above the server's own TTFT: a proxy, gateway or long network path. The server's TTFT is
    kvpilot's per-request timing, else vLLM's TTFT histogram mean, else (llama-server) its prompt time plus the
    quickest requests' time outside their prompt: what every request spent on the path (rules/prompt_gap.py)."""
    th, found = ctx.th, _ttft_gap(ctx)
    if found is None:
        return None
    gap, client_ttft, server_ttft = found.gap_ms, found.client_ms, found.server_ms
    source, confidence = found.source, found.confidence
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
