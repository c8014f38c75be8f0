"""A KV pool the server does not report, bounded from the requests it failed for want of room.

llama-server's unified KV buffer (``--kv-unified``, shared by its ``--parallel`` slots) may be smaller than its
slots' contexts together, and nothing it exports says how large it is: ``/props`` gives one slot's context,
``/metrics`` no pool. But when it fails a request because the buffer is full, the tokens then in flight did not
fit: the probe knows its own requests' prompts and the tokens each had received by then (its chunk times), so
their sum plus what the failed request needed bounds the buffer from above. That holds only when the probe was
the server's only traffic: another client's tokens would have filled part of the buffer unseen, so the bound is
taken only when the server's prompt-token counter saw no more prompt tokens than the probe sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.bench.records import RequestRecord
from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.inputs import kv_full_phrase
from kvpilot.doctor.rules.context import RuleContext

FOREIGN_SLACK = 0.1
"""Prompt tokens the server counted beyond the probe's own, as a share of those, still read as none: a failed
request's prompt may have been processed in part, and a retried one twice."""


def _held_at(r: RequestRecord, t: float) -> int:
    """Tokens ``r`` held in the KV buffer at ``t`` as the client saw it: its prompt and the tokens received so far,
    from its send to its end (none outside)."""
    end = r.sent_s + (r.e2e_ms or 0.0) / 1000.0
    if not r.sent_s <= t < end:
        return 0
    return (r.num_prompt_tokens or 0) + sum(1 for c in r.chunk_times_s if c <= t)


@dataclass(frozen=True)
class PoolBound:
    """The buffer holds fewer than ``max_tokens`` tokens: at the failure of a request that needed
    ``needed_tokens``, the probe's other requests held the rest. ``num_refused`` failures were read."""

    max_tokens: int
    needed_tokens: int
    num_refused: int


def pool_bound(ctx: RuleContext) -> PoolBound | None:
    """The tightest bound over the requests failed for a full KV buffer (module docstring); None without such a
    failure, or when other clients' prompts reached the server meanwhile (or it does not count prompt tokens)."""
    records = [r for run in ctx.inputs.runs for r in run.records]
    refused = [r for r in records if not r.ok and kv_full_phrase(r.error)]
    snap = ctx.inputs.metrics
    counted = snap.get("prompt_tokens") if snap is not None and snap.interval else None
    sent = sum(r.num_prompt_tokens or 0 for r in (*records, *ctx.inputs.set_aside))
    if not refused or counted is None or counted > (1.0 + FOREIGN_SLACK) * sent:
        return None
    best: PoolBound | None = None
    for r in refused:
        t = r.sent_s + (r.e2e_ms or 0.0) / 1000.0
        needed = (r.num_prompt_tokens or 0) + len(r.chunk_times_s) + 1
        total = needed + sum(_held_at(o, t) for o in records if o is not r)
        if best is None or total < best.max_tokens:
            best = PoolBound(total, needed, len(refused))
    return best


def estimated_pool_too_small(ctx: RuleContext) -> Finding | None:
    """kv-pool-too-small for a server that reports no pool: the bound holds fewer than ``min_max_len_requests``
    requests of its ``max_model_len`` (one slot's context); high under ``max_len_requests_high``."""
    cfg, th = ctx.inputs.server_config, ctx.th
    bound = pool_bound(ctx)
    if cfg is None or not cfg.max_model_len or bound is None:
        return None
    held = bound.max_tokens / cfg.max_model_len
    if held >= th.min_max_len_requests:
        return None
    slots = f"{cfg.max_num_seqs} slots" if cfg.max_num_seqs else "its slots"
    return Finding(
        rule_id="kv-pool-too-small", title="The KV pool holds too few requests of the maximum context",
        severity=Severity.HIGH if held < th.max_len_requests_high else Severity.MEDIUM, confidence=0.8,
        impact=clamp01(1 - held / th.min_max_len_requests),
        impact_basis="estimated from the requests the server failed for a full KV buffer",
        summary=(f"The server failed {bound.num_refused} requests for a full KV buffer while the probe's requests "
                 f"held under {bound.max_tokens:,} tokens: its KV buffer holds fewer than {held:.2f} requests of the "
                 f"{cfg.max_model_len:,}-token context each of {slots} accepts, so one long request fills it and the "
                 "others fail (llama-server: a --kv-unified buffer, --ctx-size, smaller than --parallel x the "
                 "context of a slot)."),
        evidence=(Evidence("KV buffer, at most (tokens in flight at a failure)", bound.max_tokens, "tokens", "client"),
                  Evidence("max_model_len (one slot's context)", cfg.max_model_len, "tokens", cfg.source),
                  Evidence("max_model_len requests it holds, at most", held, "x"),
                  Evidence("requests failed for a full KV buffer", bound.num_refused, "", "client")),
        fixes=(Fix(f"give the KV buffer room for {th.min_max_len_requests:.0f} requests of the context (llama-server: "
                   "--ctx-size = --parallel x the context a request needs)", kvpilot="--kv-cache-memory <larger>",
                   vllm="--gpu-memory-utilization 0.95 (or --kv-cache-memory-bytes)"),
               Fix("or cap the context each request may take", kvpilot="--max-model-len <smaller>",
                   vllm="--max-model-len <smaller>")))
