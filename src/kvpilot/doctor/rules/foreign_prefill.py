"""Long prompts the doctor did not send, stalling the decodes it measured: seen in the server's metrics.

Another client's 2,000-token prompts are invisible to the probe's records, but not to the server: over the
measured interval (two scrapes) ``vllm:request_prompt_tokens`` counts prompts longer than any the measured
runs sent, ``vllm:iteration_tokens_total`` counts steps that carried more tokens than a chunk (a long prompt
prefilled in one step), and ``vllm:request_prefill_time_seconds`` over the prompt tokens gives the prefill rate.
Every decode step that shares a step with such a prefill waits for it, so the engine time those prefills took,
over the time measured, is the share of each decode step they explain (an estimate: it assumes the decodes
ran throughout). kvpilot and vLLM export all three. llama-server has counters instead (prompt tokens, the seconds
spent on them, the longest sequence held), from which the same figures are estimated; SGLang and TGI get no finding.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.bench.records import RequestRecord
from kvpilot.doctor.findings import Evidence, Finding, Fix, LatencyShare, Severity
from kvpilot.doctor.prometheus import MetricsSnapshot
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.signals import median, quantile

FOREIGN_TITLE = "Long prompts stall decodes"
CHUNK_TOKENS = 512
"""The prefill chunk the fixes propose (kvpilot's and vLLM's --max-num-batched-tokens): short enough that a
decode step sharing it waits a fraction of a long prompt's prefill."""
DISAGG_FIX = Fix("run prefill and decode on separate workers so no decode step waits for a long prompt "
                 "(disaggregated prefill/decode: the structural fix; docs/disaggregation.md)",
                 kvpilot="kvpilot serve --kv-role prefill (one worker), kvpilot serve --kv-role decode (another), "
                         "kvpilot proxy --prefill URL --decode URL in front",
                 vllm="--kv-transfer-config '{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}' "
                      "on a prefill and a decode instance, behind a P/D proxy")
CAP_FIX = Fix("cap the prefill tokens of one step so long prompts are chunked between decode steps",
              kvpilot=f"--max-num-batched-tokens {CHUNK_TOKENS}",
              vllm=f"--max-num-batched-tokens {CHUNK_TOKENS} --long-prefill-token-threshold {CHUNK_TOKENS // 2} "
                   "--max-num-partial-prefills 2")


@dataclass(frozen=True)
class ForeignPrefill:
    """Long prompts other clients sent during the measured interval and what they cost the measured decodes.

    ``num_long``: prompts longer than the longest the measured runs sent; ``long_tokens`` their mean length
    (the foreign prompt tokens over the foreign requests); ``num_big_steps`` steps with more than
    ``step_bound`` tokens, a bucket bound at or below two chunks (None: no step histogram); ``prefill_ms`` the estimated time to prefill one;
    ``engine_share`` the estimated share of the measured time the engine spent on them."""

    num_long: float
    long_tokens: float
    num_big_steps: float | None
    step_bound: float
    prefill_ms: float
    engine_share: float
    source: str = "vllm:request_prompt_tokens"
    prefill_source: str = "vllm:request_prefill_time_seconds"


def _measured_seconds(ctx: RuleContext) -> float:
    """The runs' spans (first send to last answer), summed: the time the measured decodes ran."""
    total = 0.0
    for run in ctx.inputs.runs:
        ok = [r for r in run.ok if r.e2e_ms is not None]
        if ok:
            total += max(r.sent_s + (r.e2e_ms or 0.0) / 1000.0 for r in ok) - min(r.sent_s for r in ok)
    return total


def _sent(ctx: RuleContext) -> list[RequestRecord]:
    """The requests the measurement sent, failed ones and those a probe set aside included: the server prefilled
    them all (a request failed for a full KV buffer after its prompt ran)."""
    return [r for run in ctx.inputs.runs for r in run.records if r.num_prompt_tokens] + \
        [r for r in ctx.inputs.set_aside if r.num_prompt_tokens]


def _long_bound(ctx: RuleContext, ours: list[float]) -> float:
    """Prompts longer than this are long: beyond the measured runs' longest and ``long_prompt_ratio`` x their
    median."""
    return max(max(ours), ctx.th.long_prompt_ratio * (median(ours) or 0.0))


def measure_foreign_prefill(ctx: RuleContext) -> ForeignPrefill | None:
    """None unless an interval of server metrics shows at least ``min_num_spikes`` prompts longer than the
    measured runs' (:func:`_long_bound`), with a prefill rate to price them. llama-server: from its counters
    (:func:`_counted_foreign_prefill`)."""
    snap, th = ctx.inputs.metrics, ctx.th
    prompts = snap.histograms.get("request_prompt_tokens") if snap is not None and snap.interval else None
    prefill = snap.histograms.get("prefill") if snap is not None else None
    sent = _sent(ctx)
    ours = [float(r.num_prompt_tokens or 0) for r in sent]
    if prompts is None and snap is not None and snap.interval and sent:
        return _counted_foreign_prefill(ctx, snap, sent, ours)
    if prompts is None or prefill is None or not ours or prompts.total <= 0:
        return None
    bound = _long_bound(ctx, ours)
    num_long = prompts.count_above(bound)
    foreign_n, foreign_tokens = prompts.count - len(ours), prompts.total - sum(ours)
    wall = _measured_seconds(ctx)
    if num_long is None or num_long < th.min_num_spikes or foreign_n <= 0 or foreign_tokens <= 0 or wall <= 0:
        return None
    per_token_ms = prefill.total * 1000.0 / prompts.total  # the long prompts dominate the token count
    long_tokens = foreign_tokens / foreign_n
    steps = snap.histograms.get("iteration_tokens") if snap is not None else None
    edge = steps.edge_at_most(max(2.0 * CHUNK_TOKENS, bound)) if steps is not None else None
    big = steps.count_above(edge) if steps is not None and edge is not None else None
    step_bound = edge if edge is not None else 2.0 * CHUNK_TOKENS
    share = min(1.0, foreign_tokens * per_token_ms / 1000.0 / wall)
    return ForeignPrefill(num_long, long_tokens, big, step_bound, long_tokens * per_token_ms, share)


def _counted_foreign_prefill(ctx: RuleContext, snap: MetricsSnapshot, sent: list[RequestRecord],
                             ours: list[float]) -> ForeignPrefill | None:
    """llama-server has no prompt histogram, but counts the prompt tokens it processed (cached ones apart) and the
    seconds of the batches that carried them, and gauges the longest sequence it has held since it started
    (``n_tokens_max``). Prompt tokens beyond the measured requests' own uncached ones are other clients'; when
    the longest sequence is a long prompt (:func:`_long_bound`) and those tokens make at least
    ``min_num_spikes`` of them, they are priced like the histogram's (their number estimated as tokens over that
    length)."""
    th = ctx.th
    tokens, seconds, longest = snap.get("prompt_tokens"), snap.get("prompt_seconds"), snap.get("max_seq_tokens")
    # n_tokens_max counts a sequence's output too: beyond the longest the measured requests held
    held = max((r.num_prompt_tokens or 0) + r.num_output_tokens for r in sent)
    wall, bound = _measured_seconds(ctx), max(_long_bound(ctx, ours), float(held))
    if not tokens or not seconds or not longest or longest <= bound or wall <= 0:
        return None
    own = sum(max(0, (r.num_prompt_tokens or 0) - (r.num_usage_cached_tokens or 0)) for r in sent)
    foreign_tokens = tokens - own
    num_long = foreign_tokens / longest
    if num_long < th.min_num_spikes:
        return None
    per_token_ms = seconds * 1000.0 / tokens
    share = min(1.0, foreign_tokens * per_token_ms / 1000.0 / wall)
    return ForeignPrefill(num_long, longest, None, 2.0 * CHUNK_TOKENS, longest * per_token_ms, share,
                          source=f"{snap.names.get('prompt_tokens', 'prompt tokens')}, "
                                 f"{snap.names.get('max_seq_tokens', 'longest sequence')}",
                          prefill_source=snap.names.get("prompt_seconds", "prompt seconds"))


def long_prompts_stall_decodes(ctx: RuleContext) -> Finding | None:
    """Other clients' long prompts, prefilled in the steps the measured requests decode in, explain at least
    ``long_prefill_share`` of their TPOT (high from ``client_lag_share_most``); see the module docstring."""
    th, f = ctx.th, measure_foreign_prefill(ctx)
    peak = ctx.inputs.peak_run
    tpot = median(r.tpot_ms for r in peak.ok) if peak is not None else None
    if f is None or f.engine_share < th.long_prefill_share or not tpot:
        return None
    unchunked = f.num_big_steps is not None and f.num_big_steps > 0
    evidence = [Evidence("prompts longer than any measured request's", f.num_long, "", f.source),
                Evidence("their mean length (estimated)", f.long_tokens, "tokens", f.source),
                Evidence("prefill of one (estimated)", f.prefill_ms, "ms", f.prefill_source),
                Evidence("engine time in those prefills", f.engine_share, "%")]
    if f.num_big_steps is not None:
        evidence.append(Evidence(f"steps over {f.step_bound:.0f} tokens", f.num_big_steps, "",
                                 "vllm:iteration_tokens_total"))
    evidence.append(Evidence("median TPOT at the highest load", tpot, "ms", "client"))
    gaps = [gap for r in peak.ok for gap in r.itl_ms]
    if gaps:
        evidence.append(Evidence("p99 inter-token gap at the highest load", quantile(gaps, 0.99), "ms", "client"))
    part = f.engine_share * tpot
    return Finding(
        rule_id="prefill-interrupts-decode", title=FOREIGN_TITLE, judged_by="peak-itl-p99",
        severity=Severity.HIGH if f.engine_share >= th.client_lag_share_most else Severity.MEDIUM,
        confidence=0.8 if unchunked else 0.6, impact=f.engine_share,
        summary=(f"{f.num_long:.0f} prompts of ~{f.long_tokens:,.0f} tokens that the measured clients did not send "
                 f"were prefilled during the measurement (~{f.prefill_ms:,.0f} ms each"
                 + (f", {f.num_big_steps:.0f} steps of over {f.step_bound:.0f} tokens: unchunked" if unchunked
                    else "") + f"): about {f.engine_share:.0%} of the engine's time, and every decode step sharing "
                 f"a step with them waited, so they explain ~{part:,.0f} of the {tpot:,.0f} ms median TPOT. Capping "
                 "the prefill per step cuts each stall to one chunk's prefill (the streams' longest gaps); "
                 "disaggregating prefill and decode removes the stalls."),
        evidence=tuple(evidence), fixes=(CAP_FIX, DISAGG_FIX),
        explains=LatencyShare(part, tpot, "median TPOT at the highest load (estimated from the server's metrics)"))
