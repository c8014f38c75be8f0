"""The scheduler's executable invariants, checked after every step in tests and by the server's
/v1/kvpilot/integrity endpoint."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvpilot.engine.kv_manager import KVCacheManager
from kvpilot.engine.request import Request, RequestStatus


class SchedulerIntegrityError(RuntimeError):
    """Scheduler bookkeeping is inconsistent: a kvpilot bug; the message says which invariant broke."""


def check_scheduler_integrity(max_num_seqs: int, running: list[Request], waiting: list[Request],
                              requests: Mapping[str, Request], key: Callable[[Request], tuple[int, ...]],
                              kv: KVCacheManager) -> None:
    """Every unfinished request is RUNNING (in policy order, holding blocks for its computed tokens) or
    WAITING/PREEMPTED (holding none); no more than max_num_seqs run; block bookkeeping is consistent."""
    if len(running) > max_num_seqs:
        raise SchedulerIntegrityError(f"{len(running)} running > max_num_seqs {max_num_seqs}")
    if running != sorted(running, key=key):
        raise SchedulerIntegrityError("running list is out of policy order")
    if {r.request_id for r in running + waiting} != set(requests) or len(running) + len(waiting) != len(requests):
        raise SchedulerIntegrityError("running + waiting != unfinished requests")
    for r in running:
        if r.status is not RequestStatus.RUNNING:
            raise SchedulerIntegrityError(f"{r} is in the running list")
        if not 0 <= r.num_output_placeholders <= 2:
            raise SchedulerIntegrityError(f"{r} has {r.num_output_placeholders} tokens in flight (at most 2)")
    for r in waiting:
        if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) or r.block_ids or \
                r.num_computed_tokens:
            raise SchedulerIntegrityError(f"{r} is in the waiting queue")
    kv.check_integrity(running + waiting)
    if kv.num_tables != len(running):
        raise SchedulerIntegrityError(f"{kv.num_tables} block tables for {len(running)} running requests")
