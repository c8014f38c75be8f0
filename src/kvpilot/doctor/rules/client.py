"""Rules about the measurement path: the load generator itself, and the network/gateway hop."""

from __future__ import annotations

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.signals import median, ratio


def _p99(dist: object) -> float:
    return float((dist or {}).get("p99") or 0.0) if isinstance(dist, dict) else 0.0


def _worst_client_lag(ctx: RuleContext) -> tuple[float, float, str] | None:
    """(p99 dispatch lag, p99 loop lag, run label) of the worst run whose client lagged, or None."""
    worst: tuple[float, float, str] | None = None
    for run in ctx.inputs.runs:
        lag = run.client_lag or {}
        dispatch, loop = _p99(lag.get("dispatch_lag_ms")), _p99(lag.get("loop_lag_ms"))
        lagged = bool(lag.get("overloaded")) or loop > ctx.th.max_client_lag_ms
        if lagged and (worst is None or max(dispatch, loop) > max(worst[0], worst[1])):
            worst = (dispatch, loop, run.label)
    return worst


def client_overload(ctx: RuleContext) -> Finding | None:
    """The load generator lagged: its latencies include its own delay (it taints the rest, so the rules
    it can explain, like network-overhead, defer to it). Uses the bench's own verdict, or the event-loop
    p99 against the threshold."""
    worst = _worst_client_lag(ctx)
    if worst is None:
        return None
    dispatch, loop, label = worst
    limit = ctx.th.max_client_lag_ms
    lag_ms = max(dispatch, loop)
    ttft = median(s.ttft_ms for s in ctx.splits)
    return Finding(
        rule_id="client-overload", title="The load generator could not keep up",
        severity=Severity.HIGH, confidence=0.9 if lag_ms > 3 * limit else 0.7,
        impact=clamp01(ratio(lag_ms, ttft) or 0.5),
        summary=(f"In run '{label}' the client sent requests up to {dispatch:.0f} ms late and its event "
                 f"loop stalled {loop:.0f} ms (p99; limit {limit:g} ms): measured latencies include "
                 "client delay, so read the other findings with care."),
        evidence=(Evidence("p99 dispatch lag", dispatch, "ms", "client"),
                  Evidence("p99 event-loop lag", loop, "ms", "client"),
                  Evidence("lag limit", limit, "ms")),
        fixes=(Fix("lower the request rate per bench process and run several processes (or machines)",
                   kvpilot="kvpilot bench --request-rate <half> (x2 processes)",
                   vllm="vllm bench serve --request-rate <half> (x2 processes)"),
               Fix("cap requests in flight per client", kvpilot="kvpilot bench --max-concurrency 64",
                   vllm="vllm bench serve --max-concurrency 64")))


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
    # A lagging load generator reads every chunk late: that delay lands in the same client - server gap,
    # so the gap cannot be pinned on the network; defer to client-overload (medium, half the confidence).
    client_lagged = _worst_client_lag(ctx) is not None
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
        fixes=(Fix("measure once directly against the server to confirm the hop is the cost",
                   kvpilot="kvpilot bench --base-url http://<server-host>:8000",
                   vllm="vllm bench serve --base-url http://<server-host>:8000"),
               Fix("stop the proxy from buffering streamed responses (SSE)",
                   kvpilot="nginx: proxy_buffering off; (or X-Accel-Buffering: no)",
                   vllm="nginx: proxy_buffering off; (or X-Accel-Buffering: no)"),
               Fix("place clients, gateway and server in one region / zone; reuse connections (keep-alive)")))
