"""Scheduler: iteration-level, one token budget per step, chunked prefill, prefix hits, preemption.

Each step: (1) running requests, decodes first, then the next chunks of partial prefills, all in policy
order; when blocks run out, the newest running request (policy order: for "priority" the lowest-priority,
newest) is preempted and recomputed later; (2) if nothing was preempted, waiting requests are admitted in
policy order while the budget, max_num_seqs and free blocks allow, prompts longer than the remaining budget
being chunked. A request is never failed for lack of blocks.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable

from kvpilot.engine.block_pool import HashFn, chained_block_hash
from kvpilot.engine.config import CacheConfig, SchedulerConfig
from kvpilot.engine.kv_manager import KVCacheManager
from kvpilot.engine.request import FinishReason, Request, RequestStatus
from kvpilot.engine.request_limits import check_request_fits
from kvpilot.engine.request_queue import make_request_queue
from kvpilot.engine.scheduler_output import RequestUpdate, ScheduledChunk, SchedulerOutput
from kvpilot.engine.scheduler_stats import SchedulerStats


class SchedulerIntegrityError(RuntimeError):
    """Scheduler bookkeeping is inconsistent: a kvpilot bug; the message says which invariant broke."""


class _Step:
    """The chunks of the step being built and the token budget left (a preempted victim refunds its chunk)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.chunks: dict[str, ScheduledChunk] = {}

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks[chunk.request_id] = chunk
        self.budget -= chunk.num_tokens

    def drop(self, request_id: str) -> None:
        chunk = self.chunks.pop(request_id, None)
        if chunk is not None:
            self.budget += chunk.num_tokens


class Scheduler:
    """Decides, step by step, which tokens of which requests the model computes.

    Invariants (check_integrity): every unfinished request is either RUNNING (in the running list, sorted
    by policy order, holding blocks for its computed tokens) or WAITING/PREEMPTED (in the waiting queue,
    holding no blocks); len(running) <= max_num_seqs; block bookkeeping is consistent.
    Not thread-safe: call it (aborts included) from the engine loop's thread, between steps.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        eos_token_id: int | None,
        clock: Callable[[], float] = time.monotonic,
        *,
        hash_fn: HashFn = chained_block_hash,
    ) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.eos_token_id = eos_token_id
        self.clock = clock
        self.kv = KVCacheManager(cache_config, hash_fn=hash_fn)
        self._waiting = make_request_queue(scheduler_config.scheduling_policy)
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._order: dict[str, int] = {}
        self._next_order = 0
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; ValueError if it could never run (too long for max_model_len or the cache)."""
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use: give each request a unique id")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} was already scheduled ({request.status.value}): create a new one")
        check_request_fits(request, self.config, self.cache_config)
        self._requests[rid] = request
        self._order[rid] = self._next_order
        self._next_order += 1
        self._waiting.add(request, self._order[rid])

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Finish the requests with reason abort, freeing their blocks at once; unknown ids are ignored."""
        self.finish_requests(request_ids, FinishReason.ABORT)

    def finish_requests(self, request_ids: str | Iterable[str], reason: FinishReason) -> None:
        """Finish unfinished requests (e.g. a stop string matched, or abort); blocks are freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        now = self.clock()
        for rid in ids:
            request = self._requests.get(rid)
            if request is not None:
                self._finish(request, reason, now)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---- one step ------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _Step(self.config.max_num_batched_tokens)
        preempted = self._schedule_running(step)
        if not preempted:
            self._schedule_waiting(step)
        finished, self._finished_ids = self._finished_ids, []
        chunks = list(step.chunks.values())
        return SchedulerOutput(
            chunks=chunks,
            num_batched_tokens=sum(c.num_tokens for c in chunks),
            preempted_request_ids=[r.request_id for r in preempted],
            finished_request_ids=finished,
        )

    def _schedule_running(self, step: _Step) -> list[Request]:
        preempted: list[Request] = []
        # Decodes first so a long prompt's next chunk never delays them; stable sort keeps policy order.
        pending = sorted(self._running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for request in pending:
            if request.status is not RequestStatus.RUNNING or step.budget == 0:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
            if num_new <= 0:
                continue  # nothing to compute (update_from_output was not called for the last step)
            if self._allocate_or_preempt(request, num_new, step, preempted):
                step.add(self._chunk(request, num_new))
        return preempted

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _Step, preempted: list[Request]) -> bool:
        """Allocate the request's slots, preempting the newest running requests until they fit.

        False if the request itself had to be preempted (it was the newest left).
        """
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self._running[-1]
            step.drop(victim.request_id)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, step: _Step) -> None:
        while self._waiting and step.budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting.peek()
            hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - hit.num_tokens, step.budget)
            if self.kv.allocate_slots(request, num_new, hit) is None:
                break  # head-of-line: admitting a later request first would starve this one
            self._waiting.pop()
            self._admit(request, hit.num_tokens)
            step.add(self._chunk(request, num_new))

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_position=start,
            block_ids=list(request.block_ids),
            needs_sample=end == request.num_tokens,
        )

    # ---- after the model ran -------------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[RequestUpdate]:
        """Advance each scheduled request by its chunk, append sampled tokens and apply token-based stops.

        Chunks of requests finished or aborted since schedule() are skipped. Returns one update per request
        that got a token, in chunk order.
        """
        now = self.clock()
        updates: list[RequestUpdate] = []
        for chunk in output.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if chunk.start_position != request.num_computed_tokens:
                raise ValueError(f"stale output for request {request.request_id!r}: chunk starts at "
                                 f"{chunk.start_position}, request has {request.num_computed_tokens} computed "
                                 f"tokens; call update_from_output once per schedule()")
            request.num_computed_tokens += chunk.num_tokens
            self.kv.cache_computed_blocks(request)
            if chunk.needs_sample:
                updates.append(self._append_token(request, self._sampled(sampled_token_ids, chunk), now))
        return updates

    @staticmethod
    def _sampled(sampled_token_ids: dict[str, int], chunk: ScheduledChunk) -> int:
        try:
            return sampled_token_ids[chunk.request_id]
        except KeyError:
            raise ValueError(f"no sampled token for request {chunk.request_id!r}: every chunk with "
                             f"needs_sample=True must get one") from None

    def _append_token(self, request: Request, token_id: int, now: float) -> RequestUpdate:
        request.append_output_token(token_id, now)
        reason = self._stop_reason(request, token_id)
        if reason is not None:
            self._finish(request, reason, now)
        return RequestUpdate(request.request_id, [token_id], reason)

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        """EOS (unless ignore_eos) or a stop token -> stop, not before min_tokens; max_tokens -> length."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            is_eos = token_id == self.eos_token_id and not params.ignore_eos
            if is_eos or token_id in params.stop_token_ids:
                return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    # ---- state transitions ---------------------------------------------------------------------------

    def _key(self, request: Request) -> tuple[int, ...]:
        order = self._order[request.request_id]
        if self.config.scheduling_policy == "priority":
            return (request.priority, order)
        return (order,)

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        now = self.clock()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.timeline.first_scheduled is None:
            request.timeline.first_scheduled = now
            request.num_cached_tokens = num_hit_tokens
        else:
            request.timeline.resumed_times.append(now)
        bisect.insort(self._running, request, key=self._key)

    def _preempt(self, request: Request) -> None:
        """Free all blocks and requeue at the front; its tokens (generated ones too) are recomputed later."""
        self._running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.timeline.preempted_times.append(self.clock())
        self.num_preemptions += 1
        self._waiting.push_front(request, self._order[request.request_id])

    def _finish(self, request: Request, reason: FinishReason, now: float) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.finished_with(reason)
        request.timeline.finished = now
        del self._requests[request.request_id]
        del self._order[request.request_id]
        self._finished_ids.append(request.request_id)

    # ---- observability -------------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        counts = self.kv.block_counts()
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_stats.num_queries,
            prefix_cache_hits=self.kv.prefix_stats.num_hits,
            num_preemptions=self.num_preemptions,
            num_free_blocks=counts.num_free,
            num_cached_blocks=counts.num_cached,
            num_used_blocks=counts.num_used,
            num_total_blocks=counts.num_total,
        )

    def check_integrity(self) -> None:
        """Raise SchedulerIntegrityError / KVCacheIntegrityError on any broken invariant (cheap enough to run
        after every step in tests, and whenever the engine is idle)."""
        running, waiting = list(self._running), list(self._waiting)
        if len(running) > self.config.max_num_seqs:
            raise SchedulerIntegrityError(f"{len(running)} running > max_num_seqs {self.config.max_num_seqs}")
        if running != sorted(running, key=self._key):
            raise SchedulerIntegrityError("running list is out of policy order")
        if {r.request_id for r in running + waiting} != set(self._requests) or \
                len(running) + len(waiting) != len(self._requests):
            raise SchedulerIntegrityError("running + waiting != unfinished requests")
        for r in running:
            if r.status is not RequestStatus.RUNNING:
                raise SchedulerIntegrityError(f"{r} is in the running list")
        for r in waiting:
            if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) or r.block_ids or \
                    r.num_computed_tokens:
                raise SchedulerIntegrityError(f"{r} is in the waiting queue")
        self.kv.check_integrity(running + waiting)
        if self.kv.num_tables != len(running):
            raise SchedulerIntegrityError(f"{self.kv.num_tables} block tables for {len(running)} running requests")
