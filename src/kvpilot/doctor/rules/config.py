"""Rules on the server's configuration that need no load: what the KV pool can hold against the
context length and the sequence cap, the token budget against the sequence cap, prefix caching.

They read :class:`~kvpilot.doctor.server_config.ServerConfig` (kvpilot's capacity endpoint, vLLM's
``vllm:cache_config_info``, ``--serve`` flags) and, where it sharpens the numbers, the request sizes
the probe or bench measured.
"""

from __future__ import annotations

import math

from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity, clamp01
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.kv_bound import estimated_pool_too_small
from kvpilot.doctor.rules.kv_cache import MIB, prefix_cache_miss, shared_prefix_traffic
from kvpilot.doctor.server_config import ServerConfig
from kvpilot.doctor.signals import median, quantile



def _measured_pressure(ctx: RuleContext) -> bool:
    """The KV pool was measured full or preempting (kv-cache-pressure then leads with that evidence)."""
    usage = ctx.view.kv_usage_max
    return (usage is not None and usage >= ctx.th.kv_usage_high) or (ctx.view.num_preemptions or 0) > 0


def _request_tokens(ctx: RuleContext, q: float) -> float | None:
    """Quantile ``q`` of prompt + output tokens over the measured requests (the server's counts)."""
    return quantile([float((r.num_prompt_tokens or 0) + r.num_output_tokens) for r in ctx.inputs.ok_records], q)


def _memory_for(cfg: ServerConfig, num_tokens: int) -> int | None:
    """KV bytes for ``num_tokens`` tokens, whole blocks (None without the per-block size)."""
    per_block = cfg.bytes_per_block
    blocks = cfg.blocks_for(num_tokens)
    return per_block * blocks if per_block and blocks else None


def kv_pool_too_small(ctx: RuleContext) -> Finding | None:
    """The KV pool holds fewer than a few ``max_model_len`` requests: one long request takes most of
    it, and the others wait (or are preempted) however short they are. A pool the server does not report is bounded
    from the requests it failed for a full buffer (kv_bound.py)."""
    cfg, th = ctx.inputs.server_config, ctx.th
    if cfg is not None and cfg.num_kv_tokens is None:  # a pool no endpoint reports (llama-server's unified buffer)
        return estimated_pool_too_small(ctx)
    held = cfg.max_len_requests if cfg is not None else None
    if cfg is None or held is None or held >= th.min_max_len_requests:
        return None
    if not cfg.max_model_len or not cfg.num_kv_tokens:  # implied by max_len_requests; narrows the types
        return None
    # Below max_len_requests_high this is the root cause kv-cache-pressure measures (it defers, see
    # kv_cache.pool_explains_pressure); above it, measured pressure leads and this says why the pool
    # fills.
    measured = _measured_pressure(ctx)
    severity = Severity.HIGH if held < th.max_len_requests_high else Severity.MEDIUM
    wanted = math.ceil(th.min_max_len_requests)
    need = _memory_for(cfg, wanted * cfg.max_model_len)
    shorter = (cfg.num_kv_tokens // wanted // (cfg.block_size or 1)) * (cfg.block_size or 1)
    longest = _request_tokens(ctx, 0.99)
    evidence = [Evidence("KV pool", cfg.num_kv_tokens, "tokens", cfg.source),
                Evidence("max_model_len", cfg.max_model_len, "tokens", cfg.source),
                Evidence("max_model_len requests the pool holds", held, "x")]
    if longest is not None:
        evidence.append(Evidence("longest measured request (p99, prompt + output)", longest, "tokens", "client"))
    fixes = [Fix(f"give the KV cache room for {wanted} requests of max_model_len",
                 kvpilot=f"--kv-cache-memory {math.ceil(need / MIB)}MiB" if need else "--kv-cache-memory <larger>",
                 vllm="--gpu-memory-utilization 0.95 (or --kv-cache-memory-bytes "
                      + (f"{need})" if need else "<larger>)"))]
    if shorter >= (longest or 0) and shorter >= (cfg.block_size or 1):
        fixes.append(Fix(f"or cap the context so {wanted} fit (the measured requests are shorter)",
                         kvpilot=f"--max-model-len {shorter}", vllm=f"--max-model-len {shorter}"))
    fixes.append(Fix("store KV in fewer bits", kvpilot="--kv-cache-dtype bfloat16 (for a float32 model) or fp8",
                     vllm="--kv-cache-dtype fp8"))
    return Finding(
        rule_id="kv-pool-too-small", title="The KV pool holds too few requests of the maximum context",
        severity=severity, confidence=0.9, impact=clamp01(1 - held / th.min_max_len_requests),
        impact_basis="estimated from the pool's size: requests of max_model_len it is short of",
        summary=(f"The KV pool holds {cfg.num_kv_tokens:,} tokens: {held:.2f} requests of max_model_len "
                 f"{cfg.max_model_len:,}. One long request takes {min(1.0, 1 / held):.0%} of it, and every other "
                 "request waits or is preempted until it finishes"
                 + (" (kv-cache-pressure measured it)." if measured else
                    "; the probe's short requests did not show it, long real ones will.")),
        evidence=tuple(evidence), fixes=tuple(fixes))


def seqs_over_kv(ctx: RuleContext) -> Finding | None:
    """``max_num_seqs`` far above what the KV pool holds at the measured request size: the scheduler
    admits sequences whose growing KV then forces preemptions (recomputed prefills)."""
    cfg, th = ctx.inputs.server_config, ctx.th
    size = median(float((r.num_prompt_tokens or 0) + r.num_output_tokens) for r in ctx.inputs.ok_records)
    if cfg is None or not cfg.max_num_seqs or not cfg.num_blocks or size is None:
        return None
    per_request = cfg.blocks_for(size)
    if not per_request:
        return None
    fits = cfg.num_blocks // per_request
    if cfg.max_num_seqs < th.seqs_over_kv_ratio * max(1, fits):
        return None
    reached = (ctx.view.running_max or 0) >= fits or (ctx.view.num_preemptions or 0) > 0
    return Finding(
        rule_id="max-num-seqs-over-kv", title="The sequence cap admits more requests than the KV pool holds",
        severity=Severity.MEDIUM if reached else Severity.LOW, confidence=0.8 if reached else 0.6,
        impact=clamp01(1 - fits / cfg.max_num_seqs) * (0.5 if reached else 0.1),
        summary=(f"max_num_seqs is {cfg.max_num_seqs}, but at the measured request size ({size:.0f} tokens, "
                 f"{per_request} blocks) the pool of {cfg.num_blocks} blocks holds {fits}: past {fits} in flight, "
                 "admitted requests are preempted and recomputed"
                 + (" (this load reached it)." if reached else "; this load stayed below it.")),
        evidence=(Evidence("max_num_seqs", cfg.max_num_seqs, "", cfg.source),
                  Evidence("KV blocks", cfg.num_blocks, "", cfg.source),
                  Evidence("median request (prompt + output)", size, "tokens", "client"),
                  Evidence("requests of that size the pool holds", fits)),
        fixes=(Fix("cap sequences at what the pool holds", kvpilot=f"--max-num-seqs {max(1, fits)}",
                   vllm=f"--max-num-seqs {max(1, fits)}"),
               Fix("or give the KV cache the memory for the cap",
                   kvpilot=f"--kv-cache-memory {math.ceil((_memory_for(cfg, cfg.max_num_seqs * size) or 0) / MIB)}MiB"
                   if cfg.bytes_per_block else "--kv-cache-memory <larger>",
                   vllm="--gpu-memory-utilization 0.95")))


def token_budget_below_seqs(ctx: RuleContext) -> Finding | None:
    """A step's token budget below the sequence cap: not every running sequence can decode each step."""
    cfg = ctx.inputs.server_config
    if cfg is None or not cfg.max_num_seqs or not cfg.max_num_batched_tokens:
        return None
    if cfg.max_num_batched_tokens >= cfg.max_num_seqs:
        return None
    return Finding(
        rule_id="token-budget-below-seqs", title="The per-step token budget is smaller than the sequence cap",
        severity=Severity.MEDIUM, confidence=0.8,
        impact=clamp01(1 - cfg.max_num_batched_tokens / cfg.max_num_seqs),
        summary=(f"max_num_batched_tokens is {cfg.max_num_batched_tokens} but max_num_seqs is {cfg.max_num_seqs}: "
                 f"with more than {cfg.max_num_batched_tokens} sequences running, some skip each decode step and "
                 "their tokens come slower, and no prefill fits beside a full decode batch."),
        evidence=(Evidence("max_num_batched_tokens", cfg.max_num_batched_tokens, "", cfg.source),
                  Evidence("max_num_seqs", cfg.max_num_seqs, "", cfg.source)),
        fixes=(Fix("let a step hold every running sequence plus some prefill",
                   kvpilot=f"--max-num-batched-tokens {max(2048, 2 * cfg.max_num_seqs)}",
                   vllm=f"--max-num-batched-tokens {max(2048, 2 * cfg.max_num_seqs)}"),
               Fix("or lower the sequence cap", kvpilot=f"--max-num-seqs {cfg.max_num_batched_tokens}",
                   vllm=f"--max-num-seqs {cfg.max_num_batched_tokens}")))


def prefix_caching_off(ctx: RuleContext) -> Finding | None:
    """Prefix caching is off and no measured reuse was lost to it (a low note: chat turns, system prompts
    and agents usually share prefixes). When prefix-cache-miss measured the loss, it reports the cause
    instead; when it could not (a starved probe whose shared-prefix requests all ran at once), this note
    still says caching is off."""
    cfg = ctx.inputs.server_config
    if cfg is None or cfg.enable_prefix_caching is not False:
        return None
    if shared_prefix_traffic(ctx) and prefix_cache_miss(ctx) is not None:
        return None
    return Finding(
        rule_id="prefix-caching-off", title="Prefix caching is off", severity=Severity.LOW, confidence=0.9,
        impact=0.1,
        summary=("The server recomputes every prompt from the first token: repeated system prompts, chat "
                 "history and agent scaffolds are prefilled again on every request."),
        evidence=(Evidence("enable_prefix_caching", 0.0, "", cfg.source),),
        fixes=(Fix("turn prefix caching on", kvpilot="--enable-prefix-caching", vllm="--enable-prefix-caching"),))
