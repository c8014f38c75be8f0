"""Rules on decode and batching: slow per-token decode, and throughput that does not grow with load."""

from __future__ import annotations

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.deferral import defer_to_host
from kvpilot.doctor.signals import median, ratio


def _decode_share(ctx: RuleContext) -> float:
    """Share of median E2E spent after the first token, at the peak load."""
    s = ctx.peak_split
    if s is None or s.e2e_ms is None or s.ttft_ms is None or s.e2e_ms <= 0:
        return 0.5
    return clamp01((s.e2e_ms - s.ttft_ms) / s.e2e_ms)


def decode_bound(ctx: RuleContext) -> Finding | None:
    """Per-token decode far from the roofline at low concurrency (bandwidth wasted), or TPOT growing
    steeply with the batch. Defers to memory-spillover (lower confidence, says so) when the server's
    own pages are in swap and read back while it generates: that is why decode is slow."""
    th, roof = ctx.th, ctx.inputs.roofline
    runs = [r for r in ctx.inputs.runs if len(r.ok) >= th.min_requests]
    if not runs:
        return None
    low = runs[0]
    tpot_low = median(r.tpot_ms for r in low.ok)
    efficiency = ratio(roof.decode_step_ms, tpot_low) if roof is not None and low.in_flight <= 2.0 else None
    pair = ctx.low_and_high()
    growth = ratio(median(r.tpot_ms for r in pair[1].ok), median(r.tpot_ms for r in pair[0].ok)) if pair else None
    slow = efficiency is not None and efficiency < th.decode_roofline_efficiency_low
    grows = growth is not None and growth >= th.tpot_growth_high
    if not (slow or grows) or tpot_low is None:
        return None
    evidence = [Evidence(f"median TPOT at {low.in_flight:.1f} in flight", tpot_low, "ms", "client")]
    if efficiency is not None and roof is not None:
        evidence += [Evidence(f"roofline TPOT floor ({roof.model} on {roof.gpu}, {roof.bound})",
                              roof.decode_step_ms, "ms", "kvpilot fit"),
                     Evidence("decode speed vs roofline", efficiency, "%")]
    if growth is not None and pair is not None:
        evidence += [Evidence(f"TPOT growth from {pair[0].in_flight:.1f} to {pair[1].in_flight:.1f} in flight",
                              growth, "x", "client")]
    parts = ([f"decode runs at {efficiency:.0%} of the memory-bandwidth limit"] if slow else []) + (
        [f"TPOT grows {growth:.1f}x as concurrency rises"] if grows else [])
    fixes = [Fix("read fewer bytes per token: quantize the weights",
                 kvpilot="--model <int4/Q4 GGUF of the model>", vllm="--quantization fp8"),
             Fix("check the attention/GEMM path: CUDA graphs on, a fused attention backend",
                 vllm="(drop --enforce-eager) VLLM_ATTENTION_BACKEND=FLASH_ATTN")]
    if grows:
        fixes.insert(0, Fix("keep interactive lanes at a smaller batch", kvpilot="--max-num-seqs <lower>",
                            vllm="--max-num-seqs <lower>"))
    severe = (efficiency is not None and efficiency < th.decode_roofline_efficiency_low / 2) or \
        (growth is not None and growth >= 2 * th.tpot_growth_high)
    return defer_to_host(ctx, Finding(
        rule_id="decode-bound", title="Decode is slow per token",
        severity=Severity.HIGH if severe else Severity.MEDIUM,
        confidence=0.8 if slow and grows else 0.7, impact=_decode_share(ctx),
        summary=_sentence("; ".join(parts)), evidence=tuple(evidence), fixes=tuple(fixes)))


def _sentence(text: str) -> str:
    """First letter up, the rest as written (str.capitalize would turn "TPOT" into "Tpot")."""
    return text[:1].upper() + text[1:] + "."


def static_batching(ctx: RuleContext) -> Finding | None:
    """Output throughput flat as concurrency grows: requests are served (almost) one at a time.

    Across runs (lowest vs highest load), or within one run: aggregate tok/s close to one stream's
    1000 / TPOT while several requests are in flight."""
    th, view = ctx.th, ctx.view
    pair = ctx.low_and_high()
    if pair is not None:
        low, high = pair
        gain = ratio(high.output_throughput, low.output_throughput)
        load_ratio = high.in_flight / low.in_flight
        basis = f"from {low.in_flight:.1f} to {high.in_flight:.1f} requests in flight"
    else:
        runs = [r for r in ctx.inputs.runs if len(r.ok) >= th.min_requests and r.in_flight >= th.min_concurrency_ratio]
        if not runs:
            return None
        high = runs[-1]
        tpot = median(r.tpot_ms for r in high.ok)
        gain = ratio(high.output_throughput, 1000.0 / tpot) if tpot else None
        load_ratio, basis = high.in_flight, f"at {high.in_flight:.1f} requests in flight vs one stream's speed"
    if gain is None or gain >= th.flat_throughput_ratio:
        return None
    one_at_a_time = view.running_max is not None and view.running_max <= 1.5
    # A server starved of CPU cannot turn more requests in flight into more throughput either.
    return defer_to_host(ctx, Finding(
        rule_id="static-batching", title="Throughput does not grow with concurrency",
        severity=Severity.HIGH if gain < 1.1 else Severity.MEDIUM,
        confidence=0.4 if one_at_a_time else 0.75, impact=clamp01(1 - gain / load_ratio),
        summary=(f"Output throughput grows only {gain:.2f}x {basis}: requests are not batched together"
                 + (" (the server runs one request at a time: see queueing)." if one_at_a_time else
                    " (static batching, a batch cap of 1, or a compute-saturated device).")),
        evidence=(Evidence("throughput gain", gain, "x", "client"), Evidence("load ratio", load_ratio, "x"),
                  *([Evidence("requests running at most", view.running_max, "", view.source)]
                    if view.running_max is not None else [])),
        fixes=(Fix("use continuous batching and let many sequences share a step",
                   kvpilot="--max-num-seqs 256", vllm="--max-num-seqs 256"),
               Fix("check the server is not limited to one slot (e.g. llama.cpp --parallel 1, TGI "
                   "--max-batch-size 1)"))))
