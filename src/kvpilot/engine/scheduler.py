"""Scheduler: iteration-level, one token budget per step, chunked prefill, prefix hits, preemption.

Each step: (1) running requests, decodes first, then the next chunks of partial prefills, all in policy
order; when blocks run out, the newest running request (policy order: for "priority" the lowest-priority,
newest) is preempted and recomputed later; (2) if nothing was preempted, waiting requests are admitted in
policy order while the budget, max_num_seqs and free blocks allow, prompts longer than the remaining budget
being chunked. A request is never failed for lack of blocks.

Speculative decoding (with a Speculator): a running decode whose tokens are all known may get k drafts
(speculator.py decides k, the proposer guesses them); its chunk computes 1 + k tokens, within the budget, and
only if blocks for them are free (speculation never preempts). update_from_output appends what the target
verified and rolls the rest back: num_computed_tokens returns to the tokens known minus one, and blocks
only rejected drafts were written to are freed (their new table length goes to the runner as
SchedulerOutput.trimmed_tables).
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
from kvpilot.engine.scheduler_output import (NewRequestData, RequestUpdate, RunningRequestData, ScheduledChunk,
                                             SchedulerOutput)
from kvpilot.engine.scheduler_integrity import check_scheduler_integrity
from kvpilot.engine.scheduler_stats import SchedulerStats, offload_stats
from kvpilot.engine.speculator import Speculator
from kvpilot.engine.step_builder import StepBuilder
from kvpilot.engine.timeline import PrefillChunk


class Scheduler:
    """Decides, step by step, which tokens of which requests the model computes.

    Invariants (check_integrity): every unfinished request is either RUNNING (in the running list, sorted
    by policy order, holding blocks for its computed tokens) or WAITING/PREEMPTED (in the waiting queue,
    holding no blocks); len(running) <= max_num_seqs; block bookkeeping is consistent; while
    `_isolated_id` names an unfinished request, schedule() computes only that request (isolate()).
    Not thread-safe: call it (aborts included) from the engine loop's thread, between steps.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        eos_token_ids: int | Iterable[int] | None,
        clock: Callable[[], float] = time.monotonic,
        *,
        hash_fn: HashFn = chained_block_hash,
        speculator: Speculator | None = None,
    ) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        # the one EOS rule: any of these ends a request (unless ignore_eos); the runner masks the same set
        # until min_tokens
        self.eos_token_ids: frozenset[int] = frozenset(
            () if eos_token_ids is None else (eos_token_ids,) if isinstance(eos_token_ids, int) else eos_token_ids)
        self.clock = clock
        self.kv = KVCacheManager(cache_config, hash_fn=hash_fn)
        self._overlap_loads = cache_config.overlap_offload_loads and self.kv.offload is not None
        self._waiting = make_request_queue(scheduler_config.scheduling_policy)
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._order: dict[str, int] = {}
        self._next_order = 0
        self._finished_ids: list[str] = []
        self._isolated_id: str | None = None  # see isolate()
        self.num_preemptions = 0
        self.speculator = speculator
        self._trimmed: dict[str, int] = {}  # request id -> blocks kept after rejected drafts, for the runner
        self.num_steps = 0  # steps scheduled so far: the next step's index
        self._last_update = 0.0  # clock at the last update_from_output: a step queued behind it starts there

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
        request.timeline.queued_step = self.num_steps

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
        """Builds the next step and advances every scheduled request's num_computed_tokens by its chunk (and
        its placeholders by one when it samples), so the following step can be scheduled before this one's
        tokens are known. Call update_from_output with this step's sampled tokens, in step order."""
        step = StepBuilder(self.config.max_num_batched_tokens)
        isolated = self._requests.get(self._isolated_id) if self._isolated_id is not None else None
        if isolated is not None:
            preempted = self._schedule_alone(step, isolated)
        else:
            preempted = self._schedule_running(step)
            if not preempted:
                self._schedule_waiting(step)
        finished, self._finished_ids = self._finished_ids, []
        return self._commit(step, [r.request_id for r in preempted], finished)

    def _schedule_running(self, step: StepBuilder, only: Request | None = None) -> list[Request]:
        preempted: list[Request] = []
        # Decodes first so a long prompt's next chunk never delays them, each group in policy order. This
        # loop runs for every running request every step: it reads plain attributes, not properties.
        pending = [only] if only is not None else _decodes_first(self._running)
        kv = self.kv
        block_size = kv.block_size
        # the price of a draft row this step; None: no drafts (no speculator, a probe alone, a large batch)
        price = self.speculator.step_price(len(self._running)) if self.speculator is not None and only is None \
            else None
        for request in pending:
            if step.budget == 0:
                break  # a budget only grows back by preempting, which needs an allocation: none comes now
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            num_placeholders = request.num_output_placeholders
            if len(request.output_token_ids) + num_placeholders >= request.sampling_params.max_tokens:
                continue  # the token in flight is its last (max_tokens): nothing more to compute
            num_new = min(request.num_tokens + num_placeholders - request.num_computed_tokens, step.budget)
            if num_new <= 0:
                continue  # nothing to compute until the tokens in flight are known
            if price is not None and num_new == 1 and not num_placeholders and \
                    self._schedule_drafts(step, request, price):
                continue
            num_blocks_before = len(request.block_ids)
            # first, what KVCacheManager.allocate_slots would find without the call: the last block has room
            if request.num_computed_tokens + num_new <= num_blocks_before * block_size or \
                    kv.allocate_slots(request, num_new) is not None or \
                    self._preempt_until_allocated(request, num_new, step, preempted):
                step.add(request, self._chunk(request, num_new), num_blocks_before)
        return preempted

    def _schedule_drafts(self, step: StepBuilder, request: Request, price: float) -> bool:
        """Schedules the decode with the drafts that pay (Speculator.drafts_for), at most what the budget and
        max_tokens leave room for (the last of them is the target's own token), if blocks for them are free;
        False (nothing scheduled) when it gets none."""
        max_drafts = min(step.budget - 1, request.sampling_params.max_tokens - len(request.output_token_ids) - 1)
        if max_drafts < 1 or self.speculator is None:
            return False
        drafts = self.speculator.drafts_for(request, price, max_drafts)
        if not drafts:
            return False
        num_new = 1 + len(drafts)
        num_blocks_before = len(request.block_ids)
        if request.num_computed_tokens + num_new > num_blocks_before * self.kv.block_size and \
                self.kv.allocate_slots(request, num_new) is None:
            return False  # no free blocks for the drafts: a plain decode instead (speculation never preempts)
        chunk = ScheduledChunk(request.request_id, request.num_computed_tokens, num_new, True)
        step.add_drafts(request, chunk, num_blocks_before, drafts)
        return True

    def _preempt_until_allocated(self, request: Request, num_new: int, step: StepBuilder,
                                 preempted: list[Request]) -> bool:
        """Preempts the newest running requests until the request's slots fit; False if the request itself
        had to be preempted (it was the newest left)."""
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self._running[-1]
            step.drop(victim.request_id)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, step: StepBuilder) -> None:
        while self._waiting and step.budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting.peek()
            if request.num_output_placeholders:
                break  # preempted while its last token is still being sampled: resume once it is known
            if self.kv.is_prefetching(request.request_id):
                break  # its tier blocks are loading beside a step in flight: admitted once that step ran
            hit = self.kv.get_computed_blocks(request)
            if step.entries and self._overlap_loads and self.kv.can_prefetch(request, hit):
                self.kv.prefetch(request, hit)  # its loads overlap this step's forward (kv_manager.py)
                break  # head-of-line, as when blocks run short: it is admitted at a later step
            num_new = min(request.num_tokens - hit.num_tokens, step.budget)
            if self.kv.allocate_slots(request, num_new, hit) is None:
                break  # head-of-line: admitting a later request first would starve this one
            self._waiting.pop()
            self._admit(request, hit.num_tokens, hit.num_tier_blocks * self.kv.block_size)
            step.add(request, self._chunk(request, num_new), 0, admitted=True)

    @staticmethod
    def _chunk(request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request.request_id, start, num_new,
                              start + num_new == request.num_tokens_with_placeholders)

    def _commit(self, step: StepBuilder, preempted_ids: list[str], finished_ids: list[str]) -> SchedulerOutput:
        """Turns the built step into the runner's diff and advances the scheduled requests."""
        new: list[NewRequestData] = []
        running: list[RunningRequestData] = []
        chunks: list[ScheduledChunk] = []
        num_sampled = 0
        for request, chunk, num_blocks_before, admitted in step.entries.values():
            if admitted:
                new.append(NewRequestData(request.request_id, request.prompt_token_ids,
                                          list(request.output_token_ids), request.sampling_params,
                                          list(request.block_ids), request.num_computed_tokens,
                                          tuple(list(ids) for ids in request.extra_block_ids)))
            else:
                block_ids = request.block_ids
                grew = len(block_ids) > num_blocks_before
                running.append(RunningRequestData(
                    request.request_id, block_ids[num_blocks_before:] if grew else [], request.num_computed_tokens,
                    tuple(ids[num_blocks_before:] for ids in request.extra_block_ids) if grew else ()))
            request.num_computed_tokens += chunk.num_tokens
            request.num_output_placeholders += chunk.needs_sample
            num_sampled += chunk.needs_sample
            chunks.append(chunk)
        trimmed = self._trimmed
        if trimmed:
            self._trimmed = {}
        step_index, self.num_steps = self.num_steps, self.num_steps + 1
        return SchedulerOutput(chunks=chunks, new_requests=new, running_requests=running,
                               preempted_request_ids=preempted_ids, finished_request_ids=finished_ids,
                               num_batched_tokens=step.num_tokens, num_sampled=num_sampled,
                               draft_token_ids=step.drafts, trimmed_tables=trimmed if trimmed else {},
                               offload=self.kv.take_offload_orders(), kv_loads=self.kv.take_kv_loads(),
                               step_index=step_index, scheduled_at=self.clock())

    # ---- after the model ran -------------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: dict[str, int],
                           verified_token_ids: dict[str, list[int]] | None = None,
                           draft_seconds: float = 0.0) -> list[RequestUpdate]:
        """Registers the blocks the step filled for prefix reuse, appends each sampled token to its request
        (one per chunk with needs_sample; a request that verified drafts: the tokens in verified_token_ids,
        _append_verified; each is charged the runner's draft_seconds) and applies token-based stops. Tokens of requests finished or aborted since
        schedule() are discarded; a request preempted since keeps its token (it was computed before the
        preemption).

        Prefetches (kv_manager.py) whose tier loads ran beside the step join the prefix cache.

        Call once per schedule(), in step order. Returns one update per request that got a token.
        """
        now = self.clock()
        updates: list[RequestUpdate] = []
        if output.offload is not None and output.offload.prefetch_ids:  # their loads ran beside this step
            self.kv.finish_prefetches(output.offload.prefetch_ids)
        requests, cache_computed_blocks = self._requests, self.kv.cache_computed_blocks
        verified = verified_token_ids or None
        drafts = output.draft_token_ids
        started, self._last_update = max(output.scheduled_at, self._last_update), now
        for chunk in output.chunks:  # every running request every step: plain attributes, few calls
            request = requests.get(chunk.request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:  # first: a finishing token frees the blocks
                # (only what this step computed: a later step in flight may have computed more; capped at
                # the known tokens, so a draft's position is never hashed)
                cache_computed_blocks(request, chunk.start_position + chunk.num_tokens)
                # a prompt's chunk (or a recompute): not a decode's one token, nor a verification of drafts
                if (chunk.num_tokens > 1 and chunk.request_id not in drafts
                        or chunk.start_position < len(request.prompt_token_ids)):
                    request.timeline.prefill_chunks.append(
                        PrefillChunk(output.step_index, chunk.num_tokens, started, now))
            if not chunk.needs_sample:
                continue
            if request.num_output_placeholders <= 0:
                raise ValueError(f"stale output for request {request.request_id!r}: no token of it is in "
                                 f"flight; call update_from_output once per schedule()")
            if verified is not None and (tokens := verified.get(chunk.request_id)) is not None:
                request.draft_time += draft_seconds
                updates.append(self._append_verified(request, chunk, tokens,
                                                     len(output.draft_token_ids.get(chunk.request_id, ())), now))
                continue
            token_id = sampled_token_ids.get(chunk.request_id)
            if token_id is None:
                raise ValueError(f"no sampled token for request {chunk.request_id!r}: every chunk with "
                                 f"needs_sample=True must get one")
            request.num_output_placeholders -= 1
            request.append_output_token(token_id, now)
            reason = self._stop_reason(request, token_id)
            if reason is not None:
                self._finish(request, reason, now)
            updates.append(RequestUpdate(request.request_id, [token_id], reason))
        return updates

    def _append_verified(self, request: Request, chunk: ScheduledChunk, tokens: list[int], num_drafts: int,
                         now: float) -> RequestUpdate:
        """A verification's tokens (accepted drafts, then the target's own), appended one by one with plain
        decoding's stop checks, so EOS, a stop token or max_tokens among them ends the request exactly there
        (the rest are dropped). Then the rejected drafts are rolled back: their K/V is not the request's, so
        num_computed_tokens returns to the tokens known minus one and blocks past the known tokens are freed."""
        request.num_output_placeholders -= 1
        num_accepted = len(tokens) - 1
        request.num_drafts += 1
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        if self.speculator is not None:
            self.speculator.record(request.request_id, num_drafts, num_accepted)
        appended: list[int] = []
        reason = None
        for token_id in tokens:
            request.append_output_token(token_id, now)
            appended.append(token_id)
            reason = self._stop_reason(request, token_id)
            if reason is not None:
                break
        if reason is not None:
            self._finish(request, reason, now)
        elif request.status is RequestStatus.RUNNING:
            request.num_computed_tokens = chunk.start_position + len(appended)
            kept = self.kv.trim(request, request.num_tokens)
            if kept is not None:
                self._trimmed[request.request_id] = kept
        return RequestUpdate(request.request_id, appended, reason)

    def observe_step_time(self, output: SchedulerOutput, seconds: float, draft_seconds: float = 0.0,
                          beside_seconds: float = 0.0) -> None:
        """How long a step took, schedule to update, of which draft_seconds computed its drafts (the
        speculator's cost model learns from both), and what its beside loads' copy took (the KV offload pacer's
        model, engine/load_pacing.py)."""
        if self.speculator is not None:
            self.speculator.observe_step(output, seconds, draft_seconds)
        if self.kv.pacer is not None:
            self.kv.observe_step(output.offload, seconds, beside_seconds)

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        """EOS (unless ignore_eos) or a stop token -> stop, not before min_tokens; max_tokens -> length."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens and (
                (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids):
            return FinishReason.STOP
        if num_output >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    # ---- recovery from a failed step (engine/step_failures.py decides who is at fault) --------------

    def roll_back(self, request_ids: Iterable[str]) -> None:
        """The steps that scheduled these requests failed, so the tokens they had in flight will never come:
        each unfinished one is preempted (blocks freed; its known tokens are recomputed when it is admitted
        again) and keeps no token in flight. The caller tells the runner to drop their rows."""
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self._preempt(request)
            request.num_output_placeholders = 0

    def isolate(self, request_id: str | None) -> None:
        """While set (to an unfinished request), each step schedules that request alone: others keep their
        state (running ones their blocks, unless preempted to make room) but compute nothing and nothing is
        admitted. The engine probes a suspect of a failed step this way. None: back to normal."""
        self._isolated_id = request_id

    def _schedule_alone(self, step: StepBuilder, request: Request) -> list[Request]:
        """Only `request` computes: its next chunk if it runs; if it waits, it is admitted, preempting the
        newest running requests while it lacks blocks or a max_num_seqs slot."""
        if request.status is RequestStatus.RUNNING:
            return self._schedule_running(step, only=request)
        preempted: list[Request] = []
        if request.num_output_placeholders:
            return preempted  # its last token is still being sampled: admit it once that is known
        while True:
            hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - hit.num_tokens, step.budget)
            if len(self._running) < self.config.max_num_seqs and \
                    self.kv.allocate_slots(request, num_new, hit) is not None:
                break
            if not self._running:
                return preempted  # cannot happen for a request that fits the cache (check_request_fits)
            victim = self._running[-1]
            self._preempt(victim)
            preempted.append(victim)
        self._waiting.remove(request)
        self._admit(request, hit.num_tokens, hit.num_tier_blocks * self.kv.block_size)
        step.add(request, self._chunk(request, num_new), 0, admitted=True)
        return preempted

    # ---- state transitions ---------------------------------------------------------------------------

    def _key(self, request: Request) -> tuple[int, ...]:
        order = self._order[request.request_id]
        if self.config.scheduling_policy == "priority":
            return (request.priority, order)
        return (order,)

    def _admit(self, request: Request, num_hit_tokens: int, num_tier_tokens: int = 0) -> None:
        """num_hit_tokens: the prefix hit, of which num_tier_tokens copied back from an offload tier."""
        now = self.clock()
        self.kv.release_prefetch(request.request_id)  # a prefetch of its hit is over: its table holds it now
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.timeline.first_scheduled is None:
            request.timeline.first_scheduled = now
            request.num_cached_tokens = num_hit_tokens
            request.num_tier_cached_tokens = num_tier_tokens
        else:
            request.timeline.resumed_times.append(now)
        bisect.insort(self._running, request, key=self._key)

    def _preempt(self, request: Request) -> None:
        """Free all blocks and requeue at the front; its tokens (generated ones too) are recomputed later."""
        self._running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._trimmed.pop(request.request_id, None)  # a resumed request sends its whole table
        request.num_preemptions += 1
        request.timeline.preempted_times.append(self.clock())
        self.num_preemptions += 1
        self._waiting.push_front(request, self._order[request.request_id])

    def _finish(self, request: Request, reason: FinishReason, now: float) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        if request.hold_kv and reason in (FinishReason.STOP, FinishReason.LENGTH):
            request.block_ids = self.kv.hold(request)  # kept for a decode worker (engine/kv_transfer.py)
        else:
            self.kv.free(request)
        request.status = RequestStatus.finished_with(reason)
        request.timeline.finished = now
        del self._requests[request.request_id]
        del self._order[request.request_id]
        self._finished_ids.append(request.request_id)
        self._trimmed.pop(request.request_id, None)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)

    # ---- observability -------------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        counts = self.kv.block_counts()
        offload = self.kv.offload
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
            **(offload_stats(self.kv) if offload is not None else {}),
        )

    def check_integrity(self) -> None:
        """Raise SchedulerIntegrityError / KVCacheIntegrityError on any broken invariant (cheap enough to run
        after every step in tests, and whenever the engine is idle)."""
        check_scheduler_integrity(self.config.max_num_seqs, list(self._running), list(self._waiting),
                                  self._requests, self._key, self.kv)


def _decodes_first(running: list[Request]) -> list[Request]:
    """The running requests with at most one token to compute (decodes) first, then the rest (partial
    prefills, resumed ones), each group in running (policy) order. A new list: preemption edits `running`."""
    rest = [r for r in running if r.num_tokens_with_placeholders - r.num_computed_tokens > 1]
    if not rest:
        return list(running)
    return [r for r in running if r.num_tokens_with_placeholders - r.num_computed_tokens <= 1] + rest
