"""Traffic that copies its prompts while speculation is off: n-gram speculation would draft those spans.

The copy share is what the client saw (bench's per-request ``num_copied_words`` of ``num_output_words``,
kvpilot.bench.prompt_copy): output words that continue a span of their prompt. Taken as the per-draft
acceptance alpha of a prompt-lookup drafter, a verification of k drafts emits 1 + alpha + ... + alpha**k tokens
for 1 + k * price rows' time (the cost model of kvpilot.doctor.rules.speculation, at the measured load), so the
estimated decode speed-up is their ratio, with k the drafts whose alpha**j beats the price (at most 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.bench.records import RequestRecord
from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.speculation import DEFAULT_NGRAM, config_flag, speculation_on, step_cost
from kvpilot.doctor.signals import median

MAX_DRAFTS = 4  # the suggested num_speculative_tokens at most (vLLM's documented n-gram example)
MEDIUM_SPEEDUP = 1.25  # an estimated decode speed-up from which the suggestion is worth a restart (--verify)


@dataclass(frozen=True)
class CopyShare:
    """Copied over output words, pooled over ``num_requests`` requests, and the per-request median."""

    share: float
    median_share: float
    num_requests: int
    num_output_words: int


def copy_share(records: list[RequestRecord]) -> CopyShare | None:
    """None when no request has output words counted (older bench results, or no text came back)."""
    counted = [r for r in records if r.num_output_words > 0]
    words = sum(r.num_output_words for r in counted)
    if not counted or words == 0:
        return None
    return CopyShare(sum(r.num_copied_words for r in counted) / words,
                     median(r.num_copied_words / r.num_output_words for r in counted) or 0.0,
                     len(counted), words)


def estimated_speedup(alpha: float, price: float) -> tuple[float, int]:
    """(decode speed-up, drafts per verification) of n-gram speculation at per-draft acceptance ``alpha``
    and row price ``price`` (module docstring); (1.0, 0) when no draft pays."""
    k = 0
    while k < MAX_DRAFTS and alpha ** (k + 1) > price:
        k += 1
    if k == 0:
        return 1.0, 0
    return sum(alpha ** j for j in range(k + 1)) / (1.0 + k * price), k


def _low_run(ctx: RuleContext) -> RunData | None:
    runs = [r for r in ctx.inputs.runs if len(r.ok) >= ctx.th.min_requests]
    return runs[0] if runs and runs[0].in_flight <= ctx.th.copy_max_in_flight else None


def prompt_copying(ctx: RuleContext) -> Finding | None:
    """Speculation off, the lowest load at most ``th.copy_max_in_flight`` in flight (memory-bound decode,
    unless the roofline says batch-1 decode is compute-bound), and at least ``th.copy_share_min`` of the
    output words copied from the prompts."""
    low = _low_run(ctx)
    roof = ctx.inputs.roofline
    if low is None or speculation_on(ctx) or (roof is not None and roof.bound == "compute"):
        return None
    copied = copy_share(ctx.inputs.ok_records)
    if copied is None or copied.num_requests < ctx.th.min_requests or copied.share < ctx.th.copy_share_min:
        return None
    cost = step_cost(ctx)
    price = cost.price(low.in_flight)
    speedup, k = estimated_speedup(copied.share, price)
    if k == 0:
        return None
    tpot = median(r.tpot_ms for r in low.ok)
    config = {**DEFAULT_NGRAM, "num_speculative_tokens": k}
    flag = config_flag(config)
    at = f"{low.in_flight:.1f} in flight"
    evidence = [
        Evidence("output words that continue a span of the prompt", copied.share, "%",
                 f"client: {copied.num_output_words} words of {copied.num_requests} answers"),
        Evidence("median per request", copied.median_share, "%", "client"),
        Evidence(f"cost of one draft row at {at} (tokens of plain decoding)", price, "", cost.source),
        Evidence(f"estimated decode speed-up with {k} n-gram drafts", speedup, "x", "cost model")]
    if tpot is not None:
        evidence += [Evidence(f"median TPOT at {at}", tpot, "ms", "client"),
                     Evidence("estimated TPOT with n-gram speculation", tpot / speedup, "ms", "cost model")]
    return Finding(
        rule_id="prompt-copying", title="Your traffic copies its prompt: turn on n-gram speculation",
        severity=Severity.MEDIUM if speedup >= MEDIUM_SPEEDUP else Severity.LOW, confidence=0.6,
        impact=clamp01(1.0 - 1.0 / speedup),
        impact_basis="estimated: of decode time at low load, from the copy share and the cost model",
        summary=(f"{copied.share:.0%} of the output words continue a span of their prompt (median "
                 f"{copied.median_share:.0%} per request) and speculation is off: at {at} prompt-lookup drafting "
                 f"of {k} tokens would decode about {speedup:.1f}x faster (an estimate; greedy outputs stay the "
                 "same token for token)."),
        evidence=tuple(evidence),
        fixes=(Fix(f"turn on n-gram (prompt lookup) speculation with {k} drafts; the engine switches it off "
                   "per step when the batch makes drafts cost more than they earn", kvpilot=flag, vllm=flag),))
