"""Judge each cause against the delay being diagnosed, after every rule has run.

Rules see one symptom each; only the whole set says which delay the report is about. Two things need
that view:

* **The client's lag.** A load generator that stalled 20 ms (p99) taints a 40 ms TTFT, but not a 3 s
  queue wait: there it is a caveat. ``client-overload`` stays a finding only when its lag is at least
  ``client_lag_share_most`` of the delay the other findings measured (the largest ``explains.part_ms`` of a
  server-side finding above low severity; without one, the highest steady load's median TTFT). Below that
  it becomes a low-severity caveat when another finding leads, or when the client shares the server's
  machine (a co-located client competes for the same cores, so some lag is expected there). Unless the
  client's own delay is most of what was measured: where the server timed its requests (kvpilot), the time
  clients saw beyond the server's own TTFT at p90 is at least half their p90 TTFT and the client's stalls
  account for it (:func:`client_tail`; llama-server, which reports each prompt's own time but no queue wait, is
  read the same way over runs where nothing waited for a slot). Then nothing the server did explains the latency
  and the client leads.
  Beside a healthy server (no other finding above low), a client whose own delay is a quarter of that p90
  (``client_tail_share``, at least ``min_client_tail_ms``) leads as a medium finding: the one delay measured.
  A server that times no request (vLLM, SGLang) is judged the same way by means: the probe's mean client TTFT
  against the server's TTFT histogram over the same interval (:func:`histogram_tail`).
* **Deferrals.** A finding that defers to another (``defers_to``) ranks below causes and takes at most its
  cause's severity; when the finding it names is not in the report, it stands on its own.
"""

from __future__ import annotations

from dataclasses import replace

from kvpilot.doctor.findings import Finding, LatencyShare, Severity
from kvpilot.doctor.rules.client import SERVER_HISTOGRAM, client_added_ttft
from kvpilot.doctor.rules.client_lag import stall_duty
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.prompt_gap import nothing_waited, path_gap, prompt_timed
from kvpilot.doctor.signals import quantile

CLIENT_RULE = "client-overload"
HISTOGRAM_TAIL = "client mean TTFT, beyond the server's TTFT histogram mean"


def _diagnosed_delay(findings: list[Finding], ctx: RuleContext) -> LatencyShare | None:
    """The delay the report is about: the largest measured delay of a server-side finding above low severity
    that stands on its own, else the highest steady load's median client TTFT (None without either)."""
    measured = [f.explains for f in findings if f.rule_id != CLIENT_RULE and f.severity is not Severity.LOW
                and not f.defers_to and f.explains is not None]
    if measured:
        return max(measured, key=lambda e: e.part_ms)
    peak = ctx.peak_split
    if peak is None or not peak.ttft_ms:
        return None
    where = f" at {peak.in_flight:.1f} in flight" if peak.in_flight is not None else ""
    return LatencyShare(peak.ttft_ms, peak.ttft_ms, f"client TTFT{where}")


def _as_caveat(client: Finding, delay: LatencyShare, co_located: bool) -> Finding:
    """``client`` re-expressed against ``delay``: low severity, its share of the same latency."""
    assert client.explains is not None  # the caller checked
    lag = client.explains.part_ms
    share = LatencyShare(lag, delay.whole_ms, delay.of)
    where = (" The client shares the server's machine and its cores, so some lag is expected; probe from "
             "another host for clean numbers." if co_located else "")
    return replace(
        client, title="A caveat: the load generator lagged", severity=Severity.LOW, impact=share.share,
        explains=share,
        summary=(f"The load generator lagged up to {lag:.0f} ms (p99, {client.explains.of}), "
                 f"{lag / delay.part_ms:.0%} of the {delay.part_ms:,.0f} ms diagnosed ({delay.of}): too little to "
                 f"explain it, so the findings above stand.{where}"))


def _run_gap(ctx: RuleContext, run: RunData, base_ms: float) -> tuple[float, float, str] | None:
    """(p90 client TTFT beyond the server's own, p90 client TTFT, what the server's side is) of one run: kvpilot's
    per-request TTFT; else, where nothing waited for a slot, llama-server's prompt time plus the one-request
    requests' quickest time outside their prompt (``base_ms``: the path's own cost, rules/prompt_gap.py). None without
    ``min_requests`` of either."""
    pairs = [(r.ttft_ms, r.server.ttft_ms) for r in run.with_server if r.ttft_ms is not None and r.server]
    of = "beyond the server's own"
    if len(pairs) < ctx.th.min_requests and nothing_waited(run):
        pairs = [(ttft, prompt + base_ms) for ttft, prompt in prompt_timed(run)]
        of = "beyond the server's prompt time and the path's own wait"
    gap, ttft = quantile([c - s for c, s in pairs], 0.9), quantile([c for c, _ in pairs], 0.9)
    return None if len(pairs) < ctx.th.min_requests or gap is None or not ttft else (gap, ttft, of)


def client_tail(ctx: RuleContext, lag_ms: float, min_share: float | None = None) -> LatencyShare | None:
    """The client-side part of the slowest requests' TTFT, when the client explains `min_share` of it (default
    ``client_lag_share_most``: most): over the runs with the server's side of each request (:func:`_run_gap`),
    p90 of (client TTFT - server TTFT) against p90 client TTFT, kept when that gap is at least that share of the
    TTFT and ``min_client_tail_ms``, and the client's stalls account for it: ``lag_ms`` (p99) is at least
    ``client_lag_share_most`` of the gap, or the loop was stalled ``client_stall_duty`` of the run's time (several
    stalls per request). Else a network hop could fill the gap (network-overhead's). None without timings."""
    th = ctx.th
    share = th.client_lag_share_most if min_share is None else min_share
    path = path_gap(ctx)
    best: LatencyShare | None = None
    for run in ctx.inputs.runs:
        found = _run_gap(ctx, run, path.low_ms if path is not None else 0.0)
        if found is None:
            continue
        gap, ttft, of = found
        if gap < share * ttft or gap < th.min_client_tail_ms:
            continue
        if lag_ms < th.client_lag_share_most * gap and stall_duty(run.client_lag) < th.client_stall_duty:
            continue
        if best is None or gap / ttft > best.share:
            best = LatencyShare(gap, ttft, f"client TTFT p90 in run '{run.label}', {of}")
    return best


def histogram_tail(ctx: RuleContext, lag_ms: float, min_share: float | None = None) -> LatencyShare | None:
    """client_tail for a server that times no request (vLLM, SGLang): the probe's mean client TTFT beyond the
    server's TTFT histogram mean over the same interval, kept on client_tail's terms (the gap `min_share` of the
    client's mean TTFT and ``min_client_tail_ms``, the client's stalls accounting for it). Means, not p90: the
    histogram gives the server's mean only."""
    th = ctx.th
    added = client_added_ttft(ctx)
    if added is None or added.source != SERVER_HISTOGRAM:
        return None
    share = th.client_lag_share_most if min_share is None else min_share
    if added.added_ms < share * added.client_ms or added.added_ms < th.min_client_tail_ms:
        return None
    duty = max((stall_duty(run.client_lag) for run in ctx.inputs.runs), default=0.0)
    if lag_ms < th.client_lag_share_most * added.added_ms and duty < th.client_stall_duty:
        return None
    return LatencyShare(added.added_ms, added.client_ms, HISTOGRAM_TAIL)


def _as_headline(client: Finding, tail: LatencyShare, severity: Severity = Severity.HIGH) -> Finding:
    """``client`` as the first finding: it explains ``tail`` of the slowest requests' TTFT (high: most of it;
    medium: a notable share beside a healthy server)."""
    verdict = ("the load generator's own delay, not the server's, is most of the latency measured"
               if severity is Severity.HIGH else "nothing on the server explains that delay; it found no fault of "
               "its own, so the load generator is the first thing to fix or move to another machine")
    seen = (f"the first token {tail.part_ms:,.0f} ms after the server sent it on average ({tail.share:.0%} of "
            f"their {tail.whole_ms:,.0f} ms mean TTFT, against the server's TTFT histogram)"
            if tail.of == HISTOGRAM_TAIL else
            f"the slowest requests' first token {tail.part_ms:,.0f} ms after the server sent it ({tail.share:.0%} of "
            f"their {tail.whole_ms:,.0f} ms p90 TTFT)")
    return replace(client, severity=severity, impact=tail.share, explains=tail,
                   summary=client.summary + f" The clients saw {seen}: {verdict}.")


def judge_client(findings: list[Finding], ctx: RuleContext) -> list[Finding]:
    """``findings`` with client-overload judged against the diagnosed delay (see the module docstring)."""
    client = next((f for f in findings if f.rule_id == CLIENT_RULE), None)
    if client is None or client.explains is None or client.defers_to:
        return findings
    lag = client.explains.part_ms
    tail = client_tail(ctx, lag) or histogram_tail(ctx, lag)
    if tail is not None:
        return [_as_headline(f, tail) if f is client else f for f in findings]
    delay = _diagnosed_delay(findings, ctx)
    if delay is None or delay.part_ms <= 0 or client.explains.part_ms >= ctx.th.client_lag_share_most * delay.part_ms:
        return findings
    others = any(f is not client and f.severity is not Severity.LOW and f.defers_to != CLIENT_RULE for f in findings)
    co_located = ctx.inputs.client_co_located
    if not (others or co_located):
        return findings
    notable = None if others else (client_tail(ctx, lag, ctx.th.client_tail_share)
                                   or histogram_tail(ctx, lag, ctx.th.client_tail_share))
    if notable is not None:
        return [_as_headline(f, notable, Severity.MEDIUM) if f is client else f for f in findings]
    return [_as_caveat(f, delay, co_located) if f is client else f for f in findings]


def settle_deferrals(findings: list[Finding]) -> list[Finding]:
    """A finding whose ``defers_to`` names a finding not in the report stands on its own; one whose cause is in
    the report takes at most that cause's severity, so a symptom never ranks above what explains it."""
    by_id = {f.rule_id: f for f in findings}
    out = []
    for f in findings:
        cause = by_id.get(f.defers_to) if f.defers_to else None
        if f.defers_to and cause is None:
            f = replace(f, defers_to="")
        elif cause is not None and f.severity.rank > cause.severity.rank:
            f = replace(f, severity=cause.severity)
        out.append(f)
    return out


def attribute(findings: list[Finding], ctx: RuleContext) -> list[Finding]:
    """Both passes, in the rules' order (ranking comes after)."""
    return settle_deferrals(judge_client(findings, ctx))
