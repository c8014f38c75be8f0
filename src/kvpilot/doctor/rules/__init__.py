"""The diagnosis rules, in the order a careful engineer checks them: the host (CPU, swap) and the
configuration, the measurement, then the request's path (queue, tokenize, prefill, decode, memory) and,
across replicas, its routing. The order is also the precedence between findings of one severity and share
band (kvpilot.doctor.ranking): causes before the stages they slow.
Each is ``RuleContext -> Finding | None``."""

from __future__ import annotations

from kvpilot.doctor.rules.client import client_overload, network_overhead
from kvpilot.doctor.rules.config import (kv_pool_too_small, prefix_caching_off, seqs_over_kv,
                                         token_budget_below_seqs)
from kvpilot.doctor.rules.context import Rule, RuleContext
from kvpilot.doctor.rules.decode import decode_bound, static_batching
from kvpilot.doctor.rules.degraded import degraded_run
from kvpilot.doctor.rules.kv_cache import kv_pressure, prefix_cache_miss
from kvpilot.doctor.rules.offload import prefix_recomputed
from kvpilot.doctor.rules.spillover import memory_spillover
from kvpilot.doctor.rules.prompt_copying import prompt_copying
from kvpilot.doctor.rules.prefill import long_short_mixing, prefill_bound, prefill_interrupts_decode
from kvpilot.doctor.rules.queueing import queueing, tokenization
from kvpilot.doctor.rules.routing import prefix_blind_routing, replica_imbalance
from kvpilot.doctor.rules.slo_floor import slo_floor
from kvpilot.doctor.rules.speculation import speculation_costs
from kvpilot.doctor.rules.starvation import cpu_starvation
from kvpilot.doctor.rules.workload import workload_tuning

RECOMMENDATIONS: tuple[Rule, ...] = (workload_tuning,)
"""Rules that suggest settings for a stated goal (low severity) rather than name a fault."""

RULES: tuple[Rule, ...] = (
    cpu_starvation, memory_spillover, degraded_run, kv_pool_too_small, seqs_over_kv, token_budget_below_seqs,
    prefix_caching_off, client_overload, network_overhead, queueing, tokenization, kv_pressure, prefill_bound,
    slo_floor, speculation_costs, decode_bound, static_batching, prefill_interrupts_decode, prefix_cache_miss,
    prefix_recomputed, prefix_blind_routing, replica_imbalance, long_short_mixing, prompt_copying, *RECOMMENDATIONS,
)

__all__ = ["RECOMMENDATIONS", "RULES", "Rule", "RuleContext"]
