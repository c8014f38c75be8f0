"""Speculation that costs more than it earns at the measured load.

The doctor judges speculation by the cost model kvpilot's engine runs by (docs/engine.md, "Speculative
decoding"), restated here from what any server reports, so it holds for vLLM too. A decode step of r rows
takes t(r) = fixed + per_row * r (a request verifying k drafts is 1 + k rows). In a step of B requests one more
row costs ``price = per_row * B / t(B)`` tokens of plain decoding: about 0 for one stream on a memory-bound
device, near 1 once steps are compute-bound. Draft position j earns its acceptance rate a_j (the share of
verifications that accepted it, vLLM's ``spec_decode_num_accepted_tokens_per_pos`` over ``num_drafts``), so a
speculating request makes ``(1 + accepted) / (1 + drafted * price)`` times the tokens per step time that plain
decoding would, with ``accepted`` and ``drafted`` its tokens per verification; below 1 speculation costs, and
only the positions with ``a_j > price`` pay.

The step line comes from the roofline (``--model``/``--gpu``: batch-1 step and the step at fit's batch), else
from the engine's prior (a row costs an eighth of the weight read), said so in the evidence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.signals import median

PRIOR_ROW_FRACTION = 1 / 8
"""The engine's starting guess (kvpilot.engine.spec_cost): one row costs this share of a step's fixed cost."""
DEFAULT_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
"""The n-gram configuration prompt-copying suggests (vLLM's documented example)."""


@dataclass(frozen=True)
class StepCost:
    """t(r) = fixed_ms + per_row_ms * r near the measured batch; ``source`` says where the line came from.
    Invariant: ``fixed_ms > 0``, ``per_row_ms >= 0``."""

    fixed_ms: float
    per_row_ms: float
    source: str

    def step_ms(self, batch: float) -> float:
        return self.fixed_ms + self.per_row_ms * max(batch, 1.0)

    def price(self, batch: float) -> float:
        """Tokens of plain decoding one extra row costs in a step of ``batch`` rows, in [0, 1)."""
        rows = max(batch, 1.0)
        return self.per_row_ms * rows / self.step_ms(rows)

    def batch_at_price(self, price: float) -> float:
        """The batch at which one row costs ``price`` tokens (inf when rows are free)."""
        if self.per_row_ms <= 0 or price >= 1:
            return float("inf")
        return price * self.fixed_ms / (self.per_row_ms * (1 - price))


def step_cost(ctx: RuleContext) -> StepCost:
    """The roofline's line through its batch-1 step and its step at fit's batch, else the engine's prior."""
    roof = ctx.inputs.roofline
    if roof is not None and roof.batch_size > 1 and roof.aggregate_tokens_per_s > 0 and roof.decode_step_ms > 0:
        at_batch = roof.batch_size * 1000.0 / roof.aggregate_tokens_per_s
        per_row = max(0.0, (at_batch - roof.decode_step_ms) / (roof.batch_size - 1))
        fixed = max(roof.decode_step_ms - per_row, 1e-3 * roof.decode_step_ms)
        return StepCost(fixed, per_row, f"roofline of {roof.model} on {roof.gpu} (kvpilot fit)")
    return StepCost(1.0, PRIOR_ROW_FRACTION, "the engine's prior: a row costs 1/8 of a step's weight read")


@dataclass(frozen=True)
class Acceptance:
    """Speculation's counts over some requests: ``num_drafts`` verifications, ``num_draft_tokens`` drafted,
    ``num_accepted_tokens`` accepted; ``per_pos``: acceptance rate by draft position (empty: not reported)."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    per_pos: tuple[float, ...]
    source: str

    @property
    def drafted(self) -> float:
        """Draft tokens per verification."""
        return self.num_draft_tokens / self.num_drafts

    @property
    def accepted(self) -> float:
        """Accepted tokens per verification."""
        return self.num_accepted_tokens / self.num_drafts

    def efficiency(self, price: float) -> float:
        """Tokens per step time of a speculating request over plain decoding's (module docstring)."""
        return (1.0 + self.accepted) / (1.0 + self.drafted * price)

    def position_rates(self) -> tuple[float, ...]:
        """a_j by position: reported, else a geometric fit (a_j = alpha**j) to the accepted tokens per
        verification over ``round(drafted)`` positions."""
        if self.per_pos:
            return self.per_pos
        k = max(1, round(self.drafted))
        target = min(self.accepted, k - 1e-9)
        lo, hi = 0.0, 1.0
        for _ in range(40):  # sum_{j<=k} alpha**j grows with alpha: bisect for the measured total
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sum(mid ** j for j in range(1, k + 1)) < target else (lo, mid)
        return tuple(lo ** j for j in range(1, k + 1))


def speculated(run: RunData) -> list[Any]:
    """The run's successful requests that verified drafts (kvpilot's per-request ``speculation`` field)."""
    return [r for r in run.ok if r.server is not None and r.server.num_drafts > 0]


def acceptance(ctx: RuleContext, run: RunData) -> Acceptance | None:
    """Speculation at ``run``: its requests' own counts (kvpilot), else the metrics' counters over the whole
    measurement (vLLM); per-position rates from the metrics either way. None when nothing was drafted."""
    snap = ctx.inputs.metrics
    per_pos: tuple[float, ...] = ()
    if snap is not None and (snap.get("spec_drafts") or 0) > 0:
        per_pos = tuple(clamp01(n / snap.get("spec_drafts")) for n in snap.spec_accepted_per_pos)
    records = speculated(run)
    if records:
        s = [r.server for r in records]
        return Acceptance(sum(x.num_drafts for x in s), sum(x.num_draft_tokens for x in s),
                          sum(x.num_accepted_tokens for x in s), per_pos, "server timings (speculation)")
    if snap is None or not snap.get("spec_drafts") or not snap.get("spec_draft_tokens"):
        return None
    return Acceptance(snap.get("spec_drafts") or 0.0, snap.get("spec_draft_tokens") or 0.0,
                      snap.get("spec_accepted_tokens") or 0.0, per_pos, "vllm:spec_decode_* counters")


def speculation_on(ctx: RuleContext) -> bool:
    """Whether the server speculates: a request verified drafts, the counters moved, or its flags say so."""
    snap, cfg = ctx.inputs.metrics, ctx.inputs.server_config
    return (any(speculated(run) for run in ctx.inputs.runs) or (snap is not None and (snap.get("spec_drafts") or 0) > 0)
            or (cfg is not None and cfg.speculative_config is not None))


def current_config(ctx: RuleContext) -> dict[str, Any] | None:
    """The server's speculative config as a dict (from --serve flags); None when not known."""
    cfg = ctx.inputs.server_config
    text = cfg.speculative_config if cfg is not None else None
    try:
        values = json.loads(text) if text else None
    except json.JSONDecodeError:
        values = None
    return dict(values) if isinstance(values, dict) else None


def config_flag(values: dict[str, Any]) -> str:
    """``--speculative-config '{...}'`` (kvpilot and vLLM take the same JSON)."""
    return f"--speculative-config '{json.dumps(values)}'"


@dataclass(frozen=True)
class _Verdict:
    run: RunData
    acc: Acceptance
    cost: StepCost
    price: float
    efficiency: float
    rates: tuple[float, ...]
    tpot_ms: float | None
    plain_ms: float | None  # the roofline's plain decode step at that batch (None without --model/--gpu)


def _verdict(ctx: RuleContext) -> _Verdict | None:
    runs = [r for r in ctx.inputs.runs if len(r.ok) >= ctx.th.min_requests]
    if not runs:
        return None
    run = runs[-1]
    acc = acceptance(ctx, run)
    if acc is None or acc.num_drafts <= 0:
        return None
    cost = step_cost(ctx)
    price = cost.price(run.in_flight)
    tpot = median(r.tpot_ms for r in run.ok)
    plain = cost.step_ms(run.in_flight) if ctx.inputs.roofline is not None else None
    return _Verdict(run, acc, cost, price, acc.efficiency(price), acc.position_rates(), tpot, plain)


def speculation_costs(ctx: RuleContext) -> Finding | None:
    """Speculation on, and at the highest load measured the cost model says its verify rows cost more than
    the accepted drafts earn (by at least ``th.speculation_net_loss``), or TPOT there is above the roofline's
    plain-decode step at that batch while the model gives speculation no clear gain."""
    v = _verdict(ctx)
    if v is None:
        return None
    loss = 1.0 - v.efficiency
    over_roofline = v.tpot_ms is not None and v.plain_ms is not None and v.tpot_ms > v.plain_ms
    costly = loss >= ctx.th.speculation_net_loss
    if not costly and not (over_roofline and loss > -ctx.th.speculation_net_loss):
        return None
    share = len(speculated(v.run)) / len(v.run.ok) if speculated(v.run) else 1.0
    at = f"{v.run.in_flight:.1f} in flight"
    summary = (f"At {at} each draft row costs {v.price:.2f} tokens of plain decoding, and a verification of "
               f"{v.acc.drafted:.1f} drafts accepts {v.acc.accepted:.2f}: speculating requests make "
               f"{v.efficiency:.2f}x the tokens per step time plain decoding would"
               if costly else
               f"At {at} TPOT ({v.tpot_ms:.1f} ms) is above the roofline's plain-decode step at that batch "
               f"({v.plain_ms:.1f} ms) while speculation earns at most {v.efficiency:.2f}x")
    return Finding(
        rule_id="speculation-costs", title="Speculation costs you at this load",
        severity=Severity.HIGH if loss >= 0.25 else Severity.MEDIUM if costly else Severity.LOW,
        confidence=(0.75 if v.acc.per_pos else 0.65) if costly else 0.45,
        impact=clamp01(max(loss, 0.05) * share),
        impact_basis="estimated: of output throughput at that load, from the cost model",
        summary=summary + ".", evidence=tuple(_evidence(v, at)), fixes=tuple(_fixes(ctx, v)))


def _evidence(v: _Verdict, at: str) -> list[Evidence]:
    out = [Evidence(f"draft tokens per verification at {at}", v.acc.drafted, "", v.acc.source),
           Evidence("accepted tokens per verification", v.acc.accepted, "", v.acc.source),
           Evidence("draft acceptance rate", clamp01(v.acc.num_accepted_tokens / v.acc.num_draft_tokens), "%",
                    v.acc.source),
           Evidence(f"cost of one draft row at {at} (tokens of plain decoding)", v.price, "", v.cost.source),
           Evidence("tokens per step time vs plain decoding", v.efficiency, "x", "cost model")]
    out += [Evidence(f"acceptance at draft position {j + 1}", a, "%",
                     "vllm:spec_decode_num_accepted_tokens_per_pos" if v.acc.per_pos else "geometric fit")
            for j, a in enumerate(v.rates[:8])]
    if v.tpot_ms is not None:
        out.append(Evidence(f"median TPOT at {at}", v.tpot_ms, "ms", "client"))
    if v.plain_ms is not None:
        out.append(Evidence("roofline plain-decode step at that batch", v.plain_ms, "ms", v.cost.source))
    return out


def _fixes(ctx: RuleContext, v: _Verdict) -> list[Fix]:
    """Fewer drafts (the positions that pay at this load), a batch size above which none are drafted,
    and switching it off."""
    known = current_config(ctx)
    configured = int((known or {}).get("num_speculative_tokens") or max(len(v.rates), round(v.acc.drafted)))

    def flag(name: str, value: int) -> str:
        # a server whose config is not known (--url, saved files) gets a placeholder: nothing to restart with as is
        return (config_flag({**known, name: value}) if known is not None else
                f"--speculative-config '{{<your fields>, \"{name}\": {value}}}'")

    paying = sum(1 for a in v.rates if a > v.price)
    fixes = []
    if 1 <= paying < configured:
        text = flag("num_speculative_tokens", paying)
        fixes.append(Fix(f"draft only the first {paying} position(s), whose acceptance beats the row cost at this "
                         "load", kvpilot=text, vllm=text))
    first = v.rates[0] if v.rates else 0.0
    at_price = v.cost.batch_at_price(first)
    limit = int(at_price) if first > 0 and at_price < v.run.in_flight else 0
    if 2 <= limit < v.run.in_flight:
        text = flag("disable_by_batch_size", limit)
        fixes.append(Fix(f"stop drafting from {limit} requests running (where a row starts to cost more than "
                         f"the first draft's {first:.0%} acceptance earns)", kvpilot=text, vllm=text))
    fixes.append(Fix("turn speculation off for this traffic: drop --speculative-config (llama.cpp: the draft "
                     "model / --spec-type; SGLang: --speculative-algorithm; TGI: --speculate)"))
    return fixes

