"""`slo-floor`: a TTFT or E2E SLO missed even at the lightest load measured.

With one request in flight nothing queues and nothing shares a step, so no batching, budget or queue setting
can bring a request under its single-request time: the SLO asks for more than this model does on this
hardware for these prompts. Without this rule such a miss showed only in the SLO headroom line, under a
"healthy" verdict. TPOT and ITL misses at low load are decode-bound's (rules/decode.py).
"""

from __future__ import annotations

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.deferral import defer_to_host
from kvpilot.doctor.signals import median
from kvpilot.doctor.slo import GOOD_FRACTION

FLOOR_METRICS = {"ttft": "TTFT", "e2e": "E2E latency"}


def _value(record, key: str) -> float | None:  # noqa: ANN001 - a bench RequestRecord
    return record.ttft_ms if key == "ttft" else record.e2e_ms


def _misses(run: RunData, key: str, limit: float) -> tuple[float, float] | None:
    """(median value, share within the limit) when fewer than GOOD_FRACTION of the run's requests met it."""
    values = [v for r in run.ok if (v := _value(r, key)) is not None]
    if not values:
        return None
    within = sum(v <= limit for v in values) / len(values)
    return (median(values) or 0.0, within) if within < GOOD_FRACTION else None


def slo_floor(ctx: RuleContext) -> Finding | None:
    steady = [r for r in ctx.inputs.runs if r.ok and not r.burst]
    if not ctx.slos or not steady:
        return None
    lightest = min(steady, key=lambda r: r.in_flight)
    missed = {key: miss for key in FLOOR_METRICS if (limit := ctx.slos.get(key))
              and (miss := _misses(lightest, key, limit)) is not None}
    if not missed:
        return None
    prompt = median([float(r.num_prompt_tokens) for r in lightest.ok if r.num_prompt_tokens])
    evidence: list[Evidence] = [Evidence("requests in flight (the lightest load measured)", lightest.in_flight, "",
                                         "client")]
    parts = []
    for key, (value, within) in missed.items():
        name, limit = FLOOR_METRICS[key], ctx.slos[key]
        evidence += [Evidence(f"median {name}", value, "ms", "client"), Evidence(f"{name} SLO", limit, "ms"),
                     Evidence(f"requests within the {name} SLO", within, "%", "client")]
        parts.append(f"median {name} {value:,.0f} ms against {limit:,.0f} ms")
    if prompt:
        evidence.append(Evidence("median prompt", prompt, "tokens", "client"))
    roof = ctx.inputs.roofline
    if roof is not None and "ttft" in missed:
        evidence.append(Evidence(f"roofline TTFT for the median prompt ({roof.gpu})", roof.ttft_ms, "ms"))
    worst = max(value / ctx.slos[key] for key, (value, _) in missed.items())
    return defer_to_host(ctx, Finding(
        rule_id="slo-floor", title="The SLOs are missed even at the lightest load",
        severity=Severity.HIGH if worst >= 2 else Severity.MEDIUM, confidence=0.8, impact=0.7,
        summary=(f"At {lightest.in_flight:.1f} in flight, {'; '.join(parts)}: with nothing queued or batched "
                 "alongside, no scheduling setting gets a request under its single-request time. The SLO asks "
                 "for more than this model does on this hardware for these prompts."),
        evidence=tuple(evidence),
        fixes=_fixes(ctx)))


def _fixes(ctx: RuleContext) -> tuple[Fix, ...]:
    """Prefix reuse first unless the server says it is on (then `--verify` would restart for nothing); the
    rest is advice, not a flag to try (a quantized model or more GPUs change what is served)."""
    cfg = ctx.inputs.server_config
    reuse = () if cfg is not None and cfg.enable_prefix_caching is True else (
        Fix("reuse shared prompt prefixes (chat histories, system prompts) instead of recomputing them",
            kvpilot="--enable-prefix-caching", vllm="--enable-prefix-caching"),)
    return (*reuse,
            Fix("a smaller or quantized model (kvpilot on CPU: --quantization int4; vLLM: --quantization fp8)"),
            Fix("faster hardware, or more GPUs per replica (vLLM: --tensor-parallel-size 2)"),
            Fix("shorter prompts or fewer output tokens, or an SLO this deployment can meet"))
