"""Rules across replicas, from bench's per-run ``replicas`` section: prefix-blind routing (requests that
share a prefix spread over replicas, so each recomputes it) and load imbalance within a lane."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.bench.replica_report import SOURCE_COUNTER, ReplicaReport, ReplicaStats
from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext

MAX_REPLICA_LINES = 8
PREFIX_ROUTING_FIX = Fix("route by prompt prefix: requests that share leading blocks go to the replica that "
                         "already holds them (consistent hashing on block hashes, with a load bound)",
                         kvpilot="kvpilot serve --ray --num-replicas N --routing prefix",
                         vllm="llm-d's prefix-cache-aware scorer, fed by each vLLM's --kv-events-config")
AFFINITY_FIX = Fix("without a prefix-aware router, keep each session or tenant on one replica: hash a stable key "
                   "(session, user or system-prompt id) at the load balancer")
LOAD_FIX = Fix("balance by load: send each request to the less busy of two replicas (Ray Serve's default "
               "router), or bound the load a prefix hash may put on one replica",
               kvpilot="kvpilot serve --ray --num-replicas N --routing prefix (hashing with a load bound)",
               vllm="llm-d's queue-depth and KV-usage scorers")


def replica_runs(ctx: RuleContext) -> list[tuple[RunData, ReplicaReport]]:
    """Runs measured across at least two replicas, lowest load first."""
    return [(run, run.replicas) for run in ctx.inputs.runs
            if run.replicas is not None and len(run.replicas.replicas) >= 2]


@dataclass(frozen=True)
class Routing:
    """The run where prefix-blind routing lost the most reuse: hit rate vs ``bar`` (the reuse offered, or
    the fallback bar when the traffic's prefix share is unknown)."""

    run: RunData
    report: ReplicaReport
    hit: float
    bar: float
    offered: bool
    blind: bool


def measure_routing(ctx: RuleContext) -> Routing | None:
    """Runs whose traffic shares prefixes (spread > ``prefix_spread_high``, and/or an offered reuse of at least
    ``min_expected_hit_rate``) while the combined hit rate is under ``routing_hit_share_of_offered`` of it. A
    run whose groups stayed on one replica each (spread known and low) is not routing's doing."""
    th, best = ctx.th, None
    for run, rep in replica_runs(ctx):
        hit, offered, spread = rep.hit_rate, rep.offered_reuse, rep.prefix_spread
        blind = spread is not None and spread > th.prefix_spread_high
        offers = offered is not None and offered >= th.min_expected_hit_rate
        if hit is None or not (blind or offers) or (spread is not None and not blind):
            continue
        bar = offered if offered is not None else th.min_expected_hit_rate / th.prefix_hit_share_of_expected
        if hit >= th.routing_hit_share_of_offered * bar:
            continue
        if best is None or bar - hit > best.bar - best.hit:
            best = Routing(run, rep, hit, bar, offered is not None, blind)
    return best


def _per_replica_hits(rep: ReplicaReport) -> list[Evidence]:
    return [Evidence(f"prefix-cache hit rate on {r.replica}", rate, "%", r.lane or "")
            for r in rep.replicas[:MAX_REPLICA_LINES] if (rate := r.prefix_hit_rate) is not None]


def prefix_blind_routing(ctx: RuleContext) -> Finding | None:
    """Shared prefixes in the traffic, but requests of one prefix group land on several replicas, so each
    replica computes (and caches) the same prefixes and the combined prefix-cache hit rate stays low."""
    m = measure_routing(ctx)
    if m is None or ctx.view.prefix_caching_enabled is False:  # caching off: prefix-cache-miss says so
        return None
    rep, th = m.report, ctx.th
    n = len(rep.replicas)
    evidence = [Evidence("replicas", n, "", rep.source)]
    if rep.prefix_spread is not None:
        evidence.append(Evidence("replicas per prefix group (1 = affinity)", rep.prefix_spread, "",
                                 f"{rep.num_prefix_groups} groups, {rep.replicas[0].requests_source}"))
    evidence.append(Evidence("reuse the traffic offers" if m.offered else "hit rate bar (no prefix share known)",
                             m.bar, "%", "client"))
    evidence.append(Evidence("prefix-cache hit rate, all replicas", m.hit, "%", "vllm:prefix_cache_hits_total"))
    evidence += _per_replica_hits(rep)
    if rep.imbalance is not None:
        evidence.append(Evidence("imbalance (max / mean requests per replica)", rep.imbalance, "x"))
    spread = (f"each prefix group reached {rep.prefix_spread:.1f} of {n} replicas on average"
              if rep.prefix_spread is not None else f"the load was spread over {n} replicas")
    return Finding(
        rule_id="prefix-blind-routing", title="Routing ignores prompt prefixes: replicas recompute shared prefixes",
        severity=Severity.HIGH if m.hit < th.prefix_hit_share_of_expected * m.bar else Severity.MEDIUM,
        confidence=0.9 if m.blind and m.offered else (0.75 if m.blind else 0.6),
        impact=clamp01(m.bar - m.hit),
        summary=(f"The traffic shares prompt prefixes ({m.bar:.0%} of prompt tokens reusable"
                 + ("" if m.offered else ", assumed") + f"), but {spread}: every replica computes the same prefixes "
                 f"again, and only {m.hit:.0%} of prompt tokens hit a prefix cache (run '{m.run.label}')."),
        evidence=tuple(evidence), fixes=(PREFIX_ROUTING_FIX, AFFINITY_FIX))


def _busiest(rep: ReplicaReport) -> ReplicaStats | None:
    counted = [r for r in rep.replicas if r.num_requests is not None]
    return max(counted, key=lambda r: r.num_requests or 0) if counted else None


def replica_imbalance(ctx: RuleContext) -> Finding | None:
    """One replica of a lane served at least ``replica_imbalance_high`` times the lane's mean, over a run
    with at least ``min_requests`` requests per replica. Medium when the busiest replica had requests waiting
    (or its queue is unknown), a low note when nothing queued anywhere."""
    th = ctx.th
    found = [(rep.imbalance, run, rep) for run, rep in replica_runs(ctx)
             if rep.imbalance is not None and rep.imbalance >= th.replica_imbalance_high
             and sum(r.num_requests or 0 for r in rep.replicas) >= th.min_requests * len(rep.replicas)]
    if not found:
        return None
    imbalance, run, rep = max(found, key=lambda f: f[0])
    hot = _busiest(rep)
    if hot is None:
        return None
    queued = hot.waiting_max is None or hot.waiting_max >= 1
    evidence = [Evidence("imbalance (max / mean requests per replica of a lane)", imbalance, "x", rep.source)]
    evidence += [Evidence(f"requests served by {r.replica}", r.num_requests, "", r.requests_source or "")
                 for r in rep.replicas[:MAX_REPLICA_LINES] if r.num_requests is not None]
    if hot.waiting_max is not None:
        evidence.append(Evidence(f"requests waiting on {hot.replica}, max", hot.waiting_max, "",
                                 "vllm:num_requests_waiting"))
    effect = ": requests queued there while others had room." if hot.waiting_max else "."
    return Finding(
        rule_id="replica-imbalance", title="Load is uneven across replicas",
        severity=Severity.MEDIUM if queued else Severity.LOW,
        confidence=0.6 if hot.requests_source == SOURCE_COUNTER else 0.8, impact=clamp01(1 - 1 / imbalance),
        summary=(f"{hot.replica} served {hot.num_requests} requests, {imbalance:.1f}x the mean of its lane's "
                 f"replicas (run '{run.label}'){effect}"),
        evidence=tuple(evidence),
        fixes=(LOAD_FIX, Fix("add replicas to the busy lane, or autoscale it on queue depth",
                             kvpilot="autoscaling_config of the Ray Serve app (docs/ray.md)")))


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def replica_lines(ctx: RuleContext) -> list[str]:
    """Headroom lines: the highest-load run across replicas, one line for the deployment and one per replica
    (at most ``MAX_REPLICA_LINES``)."""
    runs = replica_runs(ctx) or [(run, run.replicas) for run in ctx.inputs.runs if run.replicas is not None]
    if not runs:
        return []
    run, rep = runs[-1]
    head = f"{len(rep.replicas)} replicas ({rep.source}, run '{run.label}'): imbalance "
    head += "-" if rep.imbalance is None else f"{rep.imbalance:.2f}x"
    if rep.prefix_spread is not None:
        head += f", {rep.prefix_spread:.2f} replicas per prefix group"
    head += f", prefix-cache hit rate {_pct(rep.hit_rate)}"
    head += f" of {_pct(rep.offered_reuse)} offered" if rep.offered_reuse is not None else ""
    lines = [head]
    for r in rep.replicas[:MAX_REPLICA_LINES]:
        lane = f" (lane {r.lane})" if r.lane else ""
        served = "-" if r.num_requests is None else str(r.num_requests)
        waiting = f", waiting max {r.waiting_max:.0f}" if r.waiting_max is not None else ""
        lines.append(f"  replica {r.replica}{lane}: {served} requests, prefix hit rate {_pct(r.prefix_hit_rate)}"
                     + (f" ({r.prefix_hits:,.0f} of {r.prefix_queries:,.0f} tokens)"
                        if r.prefix_hits is not None and r.prefix_queries is not None else "") + waiting)
    if len(rep.replicas) > MAX_REPLICA_LINES:
        lines.append(f"  ... and {len(rep.replicas) - MAX_REPLICA_LINES} more replicas")
    return lines
