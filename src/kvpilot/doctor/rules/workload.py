"""`--workload`: the flags that suit the goal, from what was measured (a recommendation, low severity:
`--verify` measures it before anyone keeps it).

- chat / agent: cap the batch at the most streams that met the SLOs (more only adds latency to everyone
  admitted; more replicas serve more streams), keep prefix caching on (agents resend long contexts).
- batch: as many sequences as the KV pool holds at the measured request size, and a large token budget
  (fewer, larger prefill steps): tokens per second are the goal, latency only a bound.
"""

from __future__ import annotations

import math

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.signals import median
from kvpilot.doctor.slo import busiest_meeting, format_slos, meets

BATCH_TOKEN_BUDGET = 8192
MAX_BATCH_SEQS = 256


def _slo_capacity(ctx: RuleContext) -> tuple[float, float] | None:
    """(most in flight that met every SLO, in flight of the highest steady load) when the highest missed."""
    steady = [r for r in ctx.inputs.runs if r.ok and not r.burst]
    slos = ctx.slos
    if not slos or len(steady) < 2 or meets(steady[-1], slos) is not False:
        return None
    held = busiest_meeting(steady, slos)
    return None if held is None else (held.in_flight, steady[-1].in_flight)


def _interactive(ctx: RuleContext) -> tuple[list[str], list[Evidence], list[str]]:
    flags, evidence, why = [], [], []
    capacity = _slo_capacity(ctx)
    cfg = ctx.inputs.server_config
    if capacity is not None:
        cap = max(1, int(capacity[0]))
        if cfg is None or cfg.max_num_seqs is None or cfg.max_num_seqs > cap:
            flags += ["--max-num-seqs", str(cap)]
            evidence += [Evidence("most in flight meeting the SLOs", capacity[0], "", "client"),
                         Evidence("in flight at the highest load (missed them)", capacity[1], "", "client")]
            why.append(f"the SLOs ({format_slos(ctx.slos)}) held up to {capacity[0]:.1f} streams in flight, not at "
                       f"{capacity[1]:.1f}: cap the batch there and add replicas for more")
    if cfg is not None and cfg.enable_prefix_caching is False:
        flags.append("--enable-prefix-caching")
        why.append("prefix caching is off: chat histories and agent contexts resend their prefixes every turn")
    return flags, evidence, why


def _batch(ctx: RuleContext) -> tuple[list[str], list[Evidence], list[str]]:
    flags, evidence, why = [], [], []
    cfg = ctx.inputs.server_config
    sizes = [float((r.num_prompt_tokens or 0) + r.num_output_tokens) for r in ctx.inputs.ok_records]
    size = median(sizes)
    if cfg is not None and cfg.num_kv_tokens and size:
        fits = min(MAX_BATCH_SEQS, math.floor(cfg.num_kv_tokens / size))
        if cfg.max_num_seqs is not None and fits >= 2 * cfg.max_num_seqs:
            flags += ["--max-num-seqs", str(fits)]
            evidence += [Evidence("requests the KV pool holds at the median size", fits, "", cfg.source),
                         Evidence("max_num_seqs", cfg.max_num_seqs, "", cfg.source)]
            why.append(f"the KV pool holds {fits} requests of the measured size, the batch cap is "
                       f"{cfg.max_num_seqs}")
    if cfg is not None and cfg.max_num_batched_tokens is not None and cfg.max_num_batched_tokens < BATCH_TOKEN_BUDGET:
        flags += ["--max-num-batched-tokens", str(BATCH_TOKEN_BUDGET)]
        evidence.append(Evidence("token budget per step", cfg.max_num_batched_tokens, "tokens", cfg.source))
        why.append(f"a token budget of {cfg.max_num_batched_tokens:,} splits long prompts into more steps; "
                   "throughput, not the stall a long prefill puts in others' streams, is the goal")
    return flags, evidence, why


def workload_tuning(ctx: RuleContext) -> Finding | None:
    """The flags for the `--workload` goal that differ from the server's, with the numbers behind each."""
    name = ctx.inputs.workload
    if name is None:
        return None
    flags, evidence, why = _batch(ctx) if name == "batch" else _interactive(ctx)
    if not flags:
        return None
    command = " ".join(flags)
    return Finding(
        rule_id="workload-tuning", title=f"Settings for a {name} workload",
        severity=Severity.LOW, confidence=0.6, impact=0.3,
        summary=f"For {name}: " + "; ".join(why) + f". Try `{command}` (`--verify` measures it).",
        evidence=tuple(evidence),
        fixes=(Fix(f"tune for {name}", kvpilot=command, vllm=command),))
