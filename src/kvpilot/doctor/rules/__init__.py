"""The diagnosis rules, in the order a careful engineer checks them (measurement first, then the
request's path: queue, tokenize, prefill, decode, memory). Each is ``RuleContext -> Finding | None``."""

from __future__ import annotations

from kvpilot.doctor.rules.client import client_overload, network_overhead
from kvpilot.doctor.rules.context import Rule, RuleContext
from kvpilot.doctor.rules.decode import decode_bound, static_batching
from kvpilot.doctor.rules.kv_cache import kv_pressure, prefix_cache_miss
from kvpilot.doctor.rules.spillover import memory_spillover
from kvpilot.doctor.rules.prefill import long_short_mixing, prefill_bound, prefill_interrupts_decode
from kvpilot.doctor.rules.queueing import queueing, tokenization

RULES: tuple[Rule, ...] = (
    client_overload, network_overhead, queueing, tokenization, kv_pressure, prefill_bound,
    decode_bound, static_batching, prefill_interrupts_decode, prefix_cache_miss, long_short_mixing,
    memory_spillover,
)

__all__ = ["RULES", "Rule", "RuleContext"]
