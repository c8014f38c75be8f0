"""Rules on the time before prefill: waiting for a slot (queueing) and preprocessing (tokenization)."""

from __future__ import annotations

from kvpilot.doctor.findings import Evidence, Finding, Fix, LatencyShare, Severity, clamp01
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.foreign_prefill import measure_foreign_prefill
from kvpilot.doctor.split import LatencySplit
from kvpilot.doctor.signals import pearson, ratio, slope


def _rejections(ctx: RuleContext) -> tuple[int, int]:
    """(refused, requests): HTTP 429s the bench saw, else kvpilot:requests_rejected against
    vllm:request_success from a metrics file. Admission control refusing work is queueing too."""
    rejected = sum(run.errors_by_kind.get("http_429", 0) for run in ctx.inputs.runs)
    if ctx.inputs.runs:
        return rejected, sum(len(run.records) for run in ctx.inputs.runs)
    snap = ctx.inputs.metrics
    refused = int(snap.get("rejected") or 0) if snap is not None else 0
    finished = int(snap.get("num_finished") or 0) if snap is not None else 0
    return refused, refused + finished


def queueing(ctx: RuleContext) -> Finding | None:
    """Requests wait for a slot: queue time dominates TTFT, the waiting gauge stays up, or 429s."""
    th, view, split = ctx.th, ctx.view, ctx.server_split
    queue = split.queue_ms if split else None
    share = ratio(queue, split.server_ttft_ms) if split else None
    rejected, total = _rejections(ctx)
    reject_share = rejected / total if total else 0.0
    step_ms = split.tpot_ms if split is not None and split.tpot_ms is not None else 0.0
    by_timing = queue is not None and share is not None and share >= th.queue_share_of_ttft and \
        queue >= max(th.min_queue_ms, th.min_queue_steps * step_ms)
    by_gauge = share is None and (view.waiting_mean or 0.0) >= th.min_waiting_mean
    if not (by_timing or by_gauge or reject_share >= 0.05):
        return None
    kv_full = (view.kv_usage_max or 0.0) >= th.kv_usage_high
    running = view.running_max
    behind_prefill = _waited_for_foreign_prefill(ctx, running)
    evidence = []
    if queue is not None and share is not None and split is not None:
        stat = "median" if split.source == "server timings" else "mean"
        evidence += [Evidence(f"{stat} queue time", queue, "ms", split.source),
                     Evidence("queue share of server TTFT", share, "%", split.source)]
    if view.waiting_max is not None:
        evidence += [Evidence("requests waiting, mean", view.waiting_mean or 0.0, "", view.source),
                     Evidence("requests waiting, max", view.waiting_max, "", view.source)]
    if running is not None:
        evidence.append(Evidence("requests running at most", running, "", view.source))
    if rejected:
        evidence.append(Evidence("requests refused (HTTP 429, admission queue full)", rejected, "",
                                 "client" if ctx.inputs.runs else "kvpilot:requests_rejected"))
    cause = ("the KV cache is full, so no new request fits (see kv-cache-pressure)" if kv_full else
             "no slot was short (none waited for one): they waited for steps that other clients' long prompts "
             "made long (see prefill-interrupts-decode)" if behind_prefill else
             f"at most {running:.0f} requests run at once: the server's cap on running requests"
             if running is not None else "the server runs fewer requests at once than arrive")
    cap = max(2, int(2 * (running or 1)))
    fixes = [Fix("let more requests run at once if memory allows",
                 kvpilot=f"--max-num-seqs {cap}", vllm=f"--max-num-seqs {cap}"),
             Fix("add replicas behind a load balancer", kvpilot="run another `kvpilot serve` replica",
                 vllm="--data-parallel-size 2")]
    if rejected:
        fixes.append(Fix("raise the admission queue caps (or have clients honour Retry-After)",
                         kvpilot="--max-num-queued-reqs <higher>"))
    # Without stage timings the gauges say it: more requests waiting than running, on average, means each
    # waits at least one whole service time (llama-server with one slot: 4 deferred behind 1 processing).
    crowded = by_gauge and running is not None and (view.waiting_mean or 0.0) >= max(1.0, running)
    severity = Severity.HIGH if (share or 0.0) >= 0.7 or reject_share >= 0.2 or crowded else Severity.MEDIUM
    explains = LatencyShare(queue, split.server_ttft_ms, f"server TTFT{_at(split)}") \
        if queue is not None and split is not None and split.server_ttft_ms else None
    return Finding(
        rule_id="queueing", title="Requests wait in the queue before they run",
        severity=severity, confidence=0.5 if kv_full else (0.9 if by_timing else 0.6),
        impact=clamp01(share if share is not None else max(reject_share, 0.5)),
        summary=(f"Queueing dominates: {cause}." if share is None else
                 f"Requests wait {queue:.0f} ms before running, {share:.0%} of the server's TTFT: {cause}."),
        evidence=tuple(evidence), fixes=tuple(fixes), explains=explains,
        defers_to="kv-cache-pressure" if kv_full else "prefill-interrupts-decode" if behind_prefill else "")


def _waited_for_foreign_prefill(ctx: RuleContext, running: float | None) -> bool:
    """Whether the queue time was a wait for the running step rather than for a slot: fewer requests ran than the
    server's cap, none waited in its queue (a request that arrives during a step waits for its end outside the
    scheduler's queue), and other clients' long prompts were prefilled meanwhile (foreign_prefill.py)."""
    cfg, waiting = ctx.inputs.server_config, ctx.view.waiting_max
    cap = cfg.max_num_seqs if cfg is not None else None
    if cap is None or running is None or running >= cap or waiting is None or waiting > 0:
        return False
    return measure_foreign_prefill(ctx) is not None


def _at(split: LatencySplit) -> str:
    """" at 7.8 in flight" for a run's split; "" for the metrics file's (no load level)."""
    return f" at {split.in_flight:.1f} in flight" if split.in_flight is not None else ""


def tokenization(ctx: RuleContext) -> Finding | None:
    """Preprocessing is a large part of TTFT (server timings or kvpilot:tokenization_time_seconds)."""
    th, split = ctx.th, ctx.server_split
    tok = split.tokenize_ms if split else None
    share = ratio(tok, split.server_ttft_ms) if split else None
    if tok is None or share is None or tok < th.min_tokenize_ms or share < th.tokenize_share_of_ttft:
        return None
    rows = [(float(r.server.num_prompt_tokens), r.server.tokenize_ms) for run in ctx.inputs.runs
            for r in run.with_server if r.server is not None]
    xs, ys = [x for x, _ in rows], [y for _, y in rows]
    per_1k = slope(xs, ys)
    corr = pearson(xs, ys)
    stat = "median" if split is not None and split.source == "server timings" else "mean"
    evidence = [Evidence(f"{stat} tokenize time", tok, "ms", split.source if split else ""),
                Evidence("tokenize share of server TTFT", share, "%")]
    if per_1k is not None and corr is not None:
        evidence += [Evidence("tokenize time per 1k prompt tokens", per_1k * 1000, "ms"),
                     Evidence("correlation with prompt length", corr)]
    grows = corr is not None and corr >= 0.7
    explains = LatencyShare(tok, split.server_ttft_ms, f"server TTFT{_at(split)}") \
        if split is not None and split.server_ttft_ms else None
    return Finding(
        rule_id="tokenization", title="Tokenization / preprocessing is slow",
        severity=Severity.HIGH if share >= 0.5 else Severity.MEDIUM, confidence=0.9 if grows else 0.75,
        impact=clamp01(share),
        summary=(f"Tokenizing takes {tok:.0f} ms, {share:.0%} of the server's TTFT"
                 + (", and grows with prompt length" if grows else "") + ": a slow (Python) tokenizer or "
                 "preprocessing blocking the server."),
        evidence=tuple(evidence), explains=explains,
        fixes=(Fix("use a fast (Rust) tokenizer: tokenizer.json next to the model",
                   vllm="--tokenizer-mode auto"),
               Fix("send token ids instead of text (the completions API accepts a list of ids)",
                   kvpilot='{"prompt": [ids...]}', vllm="--skip-tokenizer-init (with token-id prompts)"),
               Fix("run preprocessing in more API-server processes", vllm="--api-server-count 4")))
