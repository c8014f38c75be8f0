"""Rules on decode and batching: slow per-token decode, and throughput that does not grow with load."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.deferral import defer_to_host
from kvpilot.doctor.rules.prompt_gap import batch_wait
from kvpilot.doctor.rules.quantize import quantize_fix
from kvpilot.doctor.signals import median, ratio
from kvpilot.doctor.slo import busiest_meeting, format_slos, meets

DECODE_SLOS = ("tpot", "itl")


def _decode_share(ctx: RuleContext) -> float:
    """Share of median E2E spent after the first token, at the peak load."""
    s = ctx.peak_split
    if s is None or s.e2e_ms is None or s.ttft_ms is None or s.e2e_ms <= 0:
        return 0.5
    return clamp01((s.e2e_ms - s.ttft_ms) / s.e2e_ms)


@dataclass(frozen=True)
class _Growth:
    """TPOT from the lowest to the highest load, and whether that is a problem for this deployment."""

    low: RunData
    high: RunData
    factor: float
    expected: float | None  # what the roofline predicts for that batch growth (compute-bound steps), if known
    slo_cap: int | None  # the most in flight that met the decode SLO, when the highest load broke it
    slos: dict[str, float]

    @property
    def inefficient(self) -> bool:
        return self.expected is not None and self.factor >= 2.0 * max(1.0, self.expected)

    @property
    def breaks_slo(self) -> bool:
        return self.slo_cap is not None


def _expected_growth(ctx: RuleContext, high: RunData) -> float | None:
    """Roofline step time at the highest load's batch over the batch-1 floor (a compute-bound device
    slows each step as the batch grows; a memory-bound one hardly)."""
    roof = ctx.inputs.roofline
    if roof is None or roof.aggregate_tokens_per_s <= 0 or roof.decode_step_ms <= 0:
        return None
    batch = max(1, min(roof.batch_size, round(high.in_flight)))
    return max(1.0, batch / roof.aggregate_tokens_per_s * 1000.0 / roof.decode_step_ms)


def _growth(ctx: RuleContext) -> _Growth | None:
    pair = ctx.low_and_high()
    if pair is None:
        return None
    low, high = pair
    factor = ratio(median(r.tpot_ms for r in high.ok), median(r.tpot_ms for r in low.ok))
    slos = {k: v for k, v in ctx.slos.items() if k in DECODE_SLOS}
    cap = None
    if slos and meets(low, slos) and meets(high, slos) is False:
        held = busiest_meeting([r for r in ctx.inputs.runs if r.ok], slos)
        cap = max(1, int((held or low).in_flight))
    # With an SLO that breaks, any growth matters; without one, only steep growth is worth a note.
    if factor is None or (factor < ctx.th.tpot_growth_high and (cap is None or factor <= 1.0)):
        return None
    return _Growth(low, high, factor, _expected_growth(ctx, high), cap, slos)


def decode_bound(ctx: RuleContext) -> Finding | None:
    """Per-token decode far from the roofline at low concurrency (bandwidth wasted), or TPOT growing
    steeply with the batch. Growth alone is a trade (each step serves more streams) and a low-severity
    note unless a TPOT/ITL SLO met at low load breaks at high load (fix: cap the batch where it held) or
    it exceeds twice what the roofline predicts. Defers to memory-spillover (lower confidence, says so)
    when the server's own pages are in swap and read back while it generates."""
    th, roof = ctx.th, ctx.inputs.roofline
    runs = [r for r in ctx.inputs.runs if len(r.ok) >= th.min_requests]
    if not runs:
        return None
    low = runs[0]
    tpot_low = median(r.tpot_ms for r in low.ok)
    efficiency = ratio(roof.decode_step_ms, tpot_low) if roof is not None and low.in_flight <= 2.0 else None
    slow = efficiency is not None and efficiency < th.decode_roofline_efficiency_low
    growth = _growth(ctx)
    decode_slos = {k: v for k, v in ctx.slos.items() if k in DECODE_SLOS}
    misses_alone = bool(decode_slos) and meets(low, decode_slos) is False
    if not (slow or growth or misses_alone) or tpot_low is None:
        return None
    evidence = [Evidence(f"median TPOT at {low.in_flight:.1f} in flight", tpot_low, "ms", "client")]
    if efficiency is not None and roof is not None:
        rates = "calibrated" if roof.calibrated else "nominal"
        evidence += [Evidence(f"roofline TPOT floor ({roof.model} on {roof.gpu}, {roof.bound}, {rates})",
                              roof.decode_step_ms, "ms", "kvpilot fit"),
                     Evidence("decode speed vs roofline", efficiency, "%")]
    if growth is not None:
        evidence += _growth_evidence(growth)
    problem = growth is not None and not ctx.throughput_only and (growth.breaks_slo or growth.inefficient)
    limit = "this machine's calibrated limit" if roof is not None and roof.calibrated else "the memory-bandwidth limit"
    parts = ([f"decode runs at {efficiency:.0%} of {limit}"] if slow else []) + (
        [f"decode misses the SLO ({format_slos(decode_slos)}) even at {low.in_flight:.1f} in flight"]
        if misses_alone else []) + ([_growth_text(growth, problem)] if growth is not None else [])
    problem = problem or misses_alone
    quantize = quantize_fix(ctx)
    on_cpu = ctx.inputs.server_config is not None and ctx.inputs.server_config.fit_device == "cpu"
    fixes = ([quantize] if quantize is not None else []) + ([] if on_cpu else [  # no CUDA graphs on a CPU
        Fix("check the attention/GEMM path: CUDA graphs on, a fused attention backend",
            kvpilot="(drop --enforce-eager) --attention-backend auto",
            vllm="(drop --enforce-eager) VLLM_ATTENTION_BACKEND=FLASH_ATTN")])
    if growth is not None and growth.breaks_slo:
        fixes.insert(0, Fix(f"cap the batch where the decode SLO held ({growth.slo_cap} in flight); run more "
                            "replicas for more streams", kvpilot=f"--max-num-seqs {growth.slo_cap}",
                            vllm=f"--max-num-seqs {growth.slo_cap}"))
    elif growth is not None:
        fixes.insert(0, Fix("keep interactive lanes at a smaller batch", kvpilot="--max-num-seqs <lower>",
                            vllm="--max-num-seqs <lower>"))
    severe = (efficiency is not None and efficiency < th.decode_roofline_efficiency_low / 2) or \
        (problem and growth is not None and growth.factor >= 2 * th.tpot_growth_high) or \
        (misses_alone and tpot_low >= 2 * min(decode_slos.values()))
    severity = Severity.HIGH if severe else Severity.MEDIUM if slow or problem else Severity.LOW
    return defer_to_host(ctx, Finding(
        rule_id="decode-bound", title="Decode is slow per token",
        severity=severity, confidence=0.8 if slow and growth is not None else 0.7, impact=_decode_share(ctx),
        summary=_sentence("; ".join(parts)), evidence=tuple(evidence), fixes=tuple(fixes)))


def _growth_evidence(g: _Growth) -> list[Evidence]:
    out = [Evidence(f"TPOT growth from {g.low.in_flight:.1f} to {g.high.in_flight:.1f} in flight", g.factor, "x",
                    "client")]
    gain = ratio(g.high.output_throughput, g.low.output_throughput)
    if gain is not None:
        out.append(Evidence("output throughput gain over the same loads", gain, "x", "client"))
    if g.expected is not None:
        out.append(Evidence("TPOT growth the roofline predicts for that batch", g.expected, "x", "kvpilot fit"))
    return out


def _growth_text(g: _Growth, problem: bool) -> str:
    text = f"TPOT grows {g.factor:.1f}x as concurrency rises"
    if g.breaks_slo:
        return text + (f", breaking the SLO ({format_slos(g.slos)}) that held up to {g.slo_cap} in flight")
    if g.inefficient:
        return text + f", more than twice the {g.expected:.1f}x the roofline predicts for that batch"
    if problem:
        return text
    gain = ratio(g.high.output_throughput, g.low.output_throughput)
    traded = f" while output throughput grows {gain:.1f}x" if gain is not None else ""
    goal = ("pass a TPOT SLO to judge it (--slo tpot=50ms, or --workload chat)" if not g.slos else
            f"the SLO ({format_slos(g.slos)}) holds at the highest load" if meets(g.high, g.slos) else
            f"the SLO ({format_slos(g.slos)}) is missed at every load")
    return text + f"{traded}: each step serves more streams, a trade rather than a fault; {goal}"


def _sentence(text: str) -> str:
    """First letter up, the rest as written (str.capitalize would turn "TPOT" into "Tpot")."""
    return text[:1].upper() + text[1:] + "."


def static_batching(ctx: RuleContext) -> Finding | None:
    """Output throughput flat as concurrency grows: requests are served (almost) one at a time. Where the server
    reports its prompts' own times, new requests that wait for the running batch (rules/prompt_gap.py) say so first.

    Across runs (lowest vs highest load), or within one run: aggregate tok/s close to one stream's
    1000 / TPOT while several requests are in flight."""
    waited = batch_wait(ctx)
    if waited is not None:  # seen in the requests' own times: the strongest evidence there is
        return defer_to_host(ctx, waited)
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
    together = _batched_together(ctx, high)
    if together is not None:
        return defer_to_host(ctx, _saturated(gain, basis, together, ctx))
    one_at_a_time = view.running_max is not None and view.running_max <= 1.5
    cap = _batch_for(high.in_flight)
    # A server starved of CPU cannot turn more requests in flight into more throughput either.
    return defer_to_host(ctx, Finding(
        rule_id="static-batching", title="Throughput does not grow with concurrency",
        severity=Severity.HIGH if gain < 1.1 else Severity.MEDIUM,
        confidence=0.4 if one_at_a_time else 0.75, impact=clamp01(1 - gain / load_ratio),
        summary=(f"Output throughput grows only {gain:.2f}x {basis}: requests are not batched together"
                 + (" (the server runs one request at a time: see queueing)." if one_at_a_time else
                    " (static batching, a batch cap of 1, or a compute-saturated device).")),
        defers_to="queueing" if one_at_a_time else "",
        impact_basis="of the throughput the extra load could have added",
        evidence=(Evidence("throughput gain", gain, "x", "client"), Evidence("load ratio", load_ratio, "x"),
                  *([Evidence("requests running at most", view.running_max, "", view.source)]
                    if view.running_max is not None else [])),
        fixes=(Fix("use continuous batching and let at least the load's requests share a step",
                   kvpilot=f"--max-num-seqs {cap}", vllm=f"--max-num-seqs {cap}"),
               Fix("check the server is not limited to one slot (e.g. llama.cpp --parallel 1, TGI "
                   "--max-batch-size 1)"))))


def _batched_together(ctx: RuleContext, high: RunData) -> float | None:
    """The most requests the server ran at once, when that shows it batches continuously and its cap did not
    bind: at least two ran together and the reported ``max_num_seqs`` is at least the load's in-flight
    count. None otherwise (one at a time, no metrics, or a cap below the load)."""
    running, cfg = ctx.view.running_max, ctx.inputs.server_config
    cap = cfg.max_num_seqs if cfg is not None else None
    if running is None or running < 2 or cap is None or cap < high.in_flight:
        return None
    return running


def _saturated(gain: float, basis: str, running: float, ctx: RuleContext) -> Finding:
    """Flat throughput from a server that batched: each step was as busy as the device allows (the
    saturation knee), not a batching fault, so no batch-cap fix (the cap was not reached)."""
    cfg = ctx.inputs.server_config
    cap = cfg.max_num_seqs if cfg is not None else None
    return Finding(
        rule_id="static-batching", title="Throughput stopped growing: the device is saturated",
        severity=Severity.LOW, confidence=0.6, impact=0.1,
        summary=(f"Output throughput grows only {gain:.2f}x {basis}, but up to {running:.0f} requests ran together "
                 f"under a cap of {cap}: the server batches continuously, and its steps are as busy as this "
                 "machine allows (the saturation knee). More load only queues."),
        evidence=(Evidence("throughput gain", gain, "x", "client"),
                  Evidence("requests running at most", running, "", ctx.view.source),
                  Evidence("max_num_seqs", float(cap or 0), "", cfg.source if cfg is not None else "")),
        fixes=(Fix("for more throughput: more replicas or a faster device (the batch cap is not the limit)"),))


def _batch_for(in_flight: float) -> int:
    """A sequence cap that lets the measured load run together: the power of two at or above it (at least 2)."""
    cap = 2
    while cap < in_flight:
        cap *= 2
    return cap
