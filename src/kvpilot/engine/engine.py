"""LLMEngine: the loop shared by the offline API and the server.

One step: scheduler.schedule() (a diff) -> executor.execute_model() -> scheduler.update_from_output() ->
incremental detokenization (stop strings) -> RequestOutputs. Torch stays behind the executor.

With async scheduling, step N+1 is scheduled and launched before step N's tokens are read back: the host
prepares the next step and turns the last one's tokens into outputs while the device computes. A token
that finishes a request (EOS, stop string) is then known one step late; the extra token computed for it is
discarded, so outputs are the same as in synchronous mode.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvpilot.engine.config import CacheConfig, SchedulerConfig
from kvpilot.engine.detokenizer import IncrementalDetokenizer
from kvpilot.engine.executor import Executor, StepHandle
from kvpilot.engine.kv_transfer import KVTransferRequest, PulledKV
from kvpilot.engine.request import FinishReason, Request
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import RequestUpdate, SampledToken, SchedulerOutput
from kvpilot.engine.scheduler_stats import SchedulerStats
from kvpilot.engine.step_failures import StepFailed, StepFailures
from kvpilot.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvpilot.sampling_params import SamplingParams

logger = logging.getLogger("kvpilot.engine")


@dataclass(frozen=True)
class StepStats:
    """One engine step, for metrics and tests: tokens computed, split by kind, and how long it took.
    Speculative decoding (vLLM's spec_decode counters): num_drafts requests verified num_draft_tokens drafts,
    num_accepted_tokens of them accepted; num_accepted_tokens_per_pos[j]: verifications whose draft j was
    accepted (with every draft before it)."""

    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_scheduled_seqs: int
    num_preempted: int
    num_generated_tokens: int  # tokens generated for requests (vLLM's generation tokens)
    duration: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()


class _NoTextDetokenizer:
    """The detokenizer of a model without a tokenizer: token ids only, no text, no stop strings."""

    text = ""
    stop_reason = None

    def push(self, token_ids: list[int]) -> str:
        return ""

    def finish(self) -> str:
        return ""


class PromptError(ValueError):
    """The prompt cannot be used (empty, token ids out of the vocabulary, no tokenizer for text)."""


@dataclass(frozen=True)
class _InFlight:
    """A launched step whose tokens have not been read back yet."""

    scheduled: SchedulerOutput
    handle: StepHandle
    started: float


@dataclass
class _Tracked:
    """Engine-side state of one request: the scheduler's Request plus its text stream."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | _NoTextDetokenizer
    logprobs: list[TokenLogprob] | None = None


class LLMEngine:
    """Owns requests from add_request until their final RequestOutput.

    Invariants: every request id is unique while unfinished; a finished request's blocks are freed at once
    (scheduler) and its runner state released with the next step's diff; at most one step is in flight
    (async scheduling) and its tokens are read before the next one is scheduled after it.
    """

    def __init__(self, scheduler: Scheduler, runner: Executor, tokenizer: Any, vocab_size: int,
                 clock: Callable[[], float] = time.monotonic,
                 on_step: Callable[[StepStats], None] | None = None, *, async_scheduling: bool = False) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.async_scheduling = async_scheduling
        self._in_flight: _InFlight | None = None
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.clock = clock
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._pending_aborts: list[str] = []  # aborted since the last step: their final outputs are owed
        self.on_step = on_step  # observer of every step (metrics, tests)
        self._failures = StepFailures(scheduler, lambda rid: rid in self._tracked)  # a step that raises
        # disaggregation: where this engine's KV sender listens (remote_engine_id, remote_host, remote_port),
        # added to a prefill request's kv_transfer_params (set by the engine core's connector)
        self.kv_transfer_address: dict[str, Any] = {}

    # ---- requests in ---------------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError("this model has no tokenizer: pass prompts as lists of token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise PromptError("the prompt is empty: send at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})")
        return token_ids

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, *, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None, kv_transfer: KVTransferRequest | None = None,
                    remote_kv: PulledKV | None = None) -> str:
        """Tokenizes (timed on the request's timeline) and queues a request; returns its id.

        Raises PromptError / ValueError (too long for max_model_len or the cache; SamplingParamsError for a stop
        token id or logit_bias key outside the vocabulary; StructuredOutputsError for a grammar that does not
        compile) without side effects.
        """
        params.check_vocab(self.vocab_size)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise PromptError("structured_outputs need the model's tokenizer; this model has none")
            params.structured_outputs.check()  # StructuredOutputsError (a ValueError) for a bad grammar
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        arrival = self.clock() if arrival_time is None else arrival_time
        token_ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        request = Request(request_id, token_ids, params, arrival_time=arrival, priority=priority)
        request.timeline.tokenized = self.clock()
        # disaggregation: hold the blocks once finished (a prefill request), or start from pulled K/V
        request.hold_kv = kv_transfer is not None and kv_transfer.do_remote_decode
        request.remote_kv = remote_kv
        self.scheduler.add_request(request)
        detokenizer = IncrementalDetokenizer(self.tokenizer, stop=list(params.stop),
                                             skip_special_tokens=params.skip_special_tokens) \
            if self.tokenizer is not None else _NoTextDetokenizer()
        self._tracked[request_id] = _Tracked(request, prompt if isinstance(prompt, str) else None, detokenizer,
                                             [] if params.logprobs is not None else None)
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Aborts at once (blocks freed now); the aborted requests' final outputs come from the next step()."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.abort_requests(ids)
        self._pending_aborts.extend(i for i in ids if i in self._tracked)

    @property
    def num_failed_steps(self) -> int:
        """Steps that raised since the engine started (each rolled back its requests: step_failures.py)."""
        return self._failures.num_failures

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._pending_aborts)
                or self._in_flight is not None)

    # ---- what a serving loop reads between steps (the server's engine core) ------------------------------

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler.config

    @property
    def cache_config(self) -> CacheConfig:
        return self.scheduler.cache_config

    def stats(self) -> SchedulerStats:
        """The scheduler's snapshot now: requests running and waiting, blocks, prefix-cache counters."""
        return self.scheduler.make_stats()

    def check_integrity(self) -> None:
        """Checks the scheduler's and the KV cache's invariants; raises naming the first one broken."""
        self.scheduler.check_integrity()

    def release_held(self, request_id: str) -> bool:
        """Frees the blocks a finished prefill request held for a decode worker; False when none are held."""
        return self.scheduler.kv.release_held(request_id)

    def take_kv_events(self) -> list[Any]:
        """The KV-cache events (kv_events.py) recorded since the last call; [] when they are not recorded."""
        events = self.scheduler.kv.pool.events
        return events.take() if events is not None else []

    # ---- one step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns an output for every request that got tokens or finished (with
        async scheduling, the tokens of the step launched by the previous call)."""
        outputs = [self._finish_aborted(rid) for rid in self._pending_aborts]
        self._pending_aborts.clear()
        try:
            launched = self._launch()
            if not self.async_scheduling:
                outputs.extend(self._complete(launched) if launched is not None else [])
            else:
                previous, self._in_flight = self._in_flight, launched
                outputs.extend(self._complete(previous) if previous is not None else [])
        except StepFailed as failure:  # the runner raised: fail the request that caused it, alone
            outputs.extend(self._recover(failure))
        return [o for o in outputs if o is not None]

    def _launch(self) -> _InFlight | None:
        started = self.clock()
        self._failures.before_schedule()
        scheduled = self._failures.prepare(self.scheduler.schedule())
        if not (scheduled.chunks or scheduled.finished_request_ids or scheduled.preempted_request_ids
                or scheduled.offload):
            return None
        try:
            handle = self.runner.execute_model(scheduled)  # also releases finished requests' runner state
        except Exception as exc:  # noqa: BLE001 - judged by step_failures: one request's fault or none
            if scheduled.offload is not None:  # its KV offload copies may not have run: forget what they fill
                self.scheduler.kv.discard_offload(scheduled.offload)
            raise StepFailed([scheduled], exc, at_launch=True) from exc
        return _InFlight(scheduled, handle, started) if scheduled.chunks else None

    def _complete(self, step: _InFlight) -> list[RequestOutput | None]:
        try:
            result = step.handle.result()
        except Exception as exc:  # noqa: BLE001 - judged by step_failures
            raise StepFailed([step.scheduled], exc, at_launch=False) from exc
        self._failures.completed(step.scheduled)
        outputs = [self._fail_alone(rid, message) for rid, message in result.failed.items()]  # before their tokens
        # a failed request's tokens: discarded
        updates = self.scheduler.update_from_output(step.scheduled, result.token_ids, result.verified_token_ids,
                                                    result.draft_seconds)
        logprobs = result.logprobs  # only the requests that asked for logprobs
        outputs.extend(self._process_or_fail(update, logprobs.get(update.request_id) if logprobs else None)
                       for update in updates)
        duration = self.clock() - step.started
        self.scheduler.observe_step_time(step.scheduled, duration, result.draft_seconds, result.beside_seconds)
        if self.on_step is not None:
            self.on_step(_step_stats(step.scheduled, updates, duration, result.verified_token_ids))
        return outputs

    def _recover(self, failure: StepFailed) -> list[RequestOutput | None]:
        """After the runner raised (engine/step_failures.py): settles the other step in flight (an older one
        launched fine: its tokens count; a newer one was built on the failed one: it fails with it), rolls
        the failed steps' requests back to be probed alone, and fails those judged at fault."""
        outputs: list[RequestOutput | None] = []
        steps = list(failure.steps)
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and failure.at_launch:
            try:
                outputs.extend(self._complete(in_flight))
            except StepFailed as older:
                steps.extend(older.steps)
        elif in_flight is not None:
            steps.append(in_flight.scheduled)
        for scheduled in steps:  # prefetches loading beside a failed step: given up (their requests still wait)
            for rid in scheduled.offload.prefetch_ids if scheduled.offload is not None else ():
                self.scheduler.kv.release_prefetch(rid)
        verdict = self._failures.judge(StepFailed(steps, failure.cause, failure.at_launch))
        outputs.extend(self._fail_request(rid, message) for rid, message in verdict.failed.items())
        return outputs

    def _process_or_fail(self, update: RequestUpdate, sampled: SampledToken | None) -> RequestOutput | None:
        """_process; a request whose own output handling raises (detokenizer) is failed alone."""
        try:
            return self._process(update, sampled)
        except Exception as exc:  # noqa: BLE001 - one request's output, never the engine
            logger.exception("handling the output of request %r failed", update.request_id)
            return self._fail_request(update.request_id, f"the engine could not handle this request's output: "
                                                         f"{type(exc).__name__}: {exc}")

    def _fail_alone(self, request_id: str, message: str) -> RequestOutput | None:
        """A request the runner failed by itself (its grammar): finished with reason "error", nothing rolled back."""
        logger.warning("request %r failed alone: %s", request_id, message)
        return self._fail_request(request_id, message)

    def _fail_request(self, request_id: str, message: str) -> RequestOutput | None:
        """Finishes the request with reason "error" (blocks freed at once) and returns its final output."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        self.scheduler.finish_requests(request_id, FinishReason.ERROR)
        output = self._output(tracked, "", [], FinishReason.ERROR, None)
        output.error = message
        return output

    def _process(self, update: RequestUpdate, sampled: SampledToken | None) -> RequestOutput | None:
        tracked = self._tracked.get(update.request_id)
        if tracked is None:
            return None
        if tracked.logprobs is not None and sampled is not None and sampled.logprob is not None:
            tracked.logprobs.append(TokenLogprob(sampled.token_id, sampled.logprob, sampled.top_logprobs or []))
        token_ids = update.new_token_ids  # a fresh list per update: the output may own it
        finish_reason = update.finish_reason
        text_ids = token_ids
        stop_reason: str | int | None = None
        if finish_reason is FinishReason.STOP and token_ids:  # EOS or a stop token: its text is not output
            text_ids = token_ids[:-1]
            if token_ids[-1] in tracked.request.sampling_params.stop_token_ids:
                stop_reason = token_ids[-1]
        detokenizer = tracked.detokenizer
        # several tokens at once (speculation): a stop string among them ends the output where plain decoding
        # would have stopped, before whatever followed it (later tokens, EOS, max_tokens) in this step
        many = len(text_ids) > 1 and bool(getattr(detokenizer, "stop", None))
        num_before = len(detokenizer.token_ids) if many else 0
        delta = detokenizer.push(text_ids)
        cut = many and detokenizer.stop_reason is not None and len(detokenizer.token_ids) - num_before < len(token_ids)
        if detokenizer.stop_reason is not None and (finish_reason is None or cut):
            if cut:
                token_ids = self._cut_at_stop(tracked.request, token_ids, len(detokenizer.token_ids) - num_before)
            self.scheduler.finish_requests(update.request_id, FinishReason.STOP)
            finish_reason, stop_reason = FinishReason.STOP, detokenizer.stop_reason
        if finish_reason is not None:
            delta += detokenizer.finish()
        return self._output(tracked, delta, token_ids, finish_reason, stop_reason)

    @staticmethod
    def _cut_at_stop(request: Request, token_ids: list[int], num_consumed: int) -> list[int]:
        """The step's tokens up to the one that completed a stop string (the detokenizer consumed
        num_consumed < len(token_ids) of them); the request's output loses the rest."""
        request.truncate_output(len(request.output_token_ids) - (len(token_ids) - num_consumed))
        return token_ids[:num_consumed]

    def _finish_aborted(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        return self._output(tracked, tracked.detokenizer.finish(), [], FinishReason.ABORT, None)

    def _output(self, tracked: _Tracked, delta: str, delta_ids: list[int], finish_reason: FinishReason | None,
                stop_reason: str | int | None) -> RequestOutput:
        """A running request's output shares its live token lists (no per-step copies: O(1) per request);
        the final one owns copies, and carries the metrics (built once, at the end)."""
        request = tracked.request
        logprobs = tracked.logprobs
        if finish_reason is None:  # every running request every step: positional, shared lists
            return RequestOutput(request.request_id, tracked.prompt, request.prompt_token_ids,
                                 [CompletionOutput(0, tracked.detokenizer.text, request.output_token_ids, None,
                                                   stop_reason, logprobs)],
                                 False, None, request.num_cached_tokens, delta, delta_ids)
        self._tracked.pop(request.request_id, None)
        completion = CompletionOutput(index=0, text=tracked.detokenizer.text,
                                      token_ids=list(request.output_token_ids), finish_reason=finish_reason.value,
                                      stop_reason=stop_reason, logprobs=list(logprobs) if logprobs is not None
                                      else None)
        return RequestOutput(request_id=request.request_id, prompt=tracked.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=[completion], finished=True,
                             metrics=request.metrics(), num_cached_tokens=request.num_cached_tokens,
                             delta_text=delta, delta_token_ids=delta_ids,
                             kv_transfer_params=self._held_params(request, finish_reason))

    def _held_params(self, request: Request, finish_reason: FinishReason) -> dict[str, Any] | None:
        """A prefill request's kv_transfer_params (vLLM's names): the blocks it holds for a decode worker."""
        if not request.hold_kv or finish_reason not in (FinishReason.STOP, FinishReason.LENGTH) \
                or not request.block_ids:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False, **self.kv_transfer_address,
                "remote_request_id": request.request_id, "remote_block_ids": list(request.block_ids),
                "num_remote_tokens": request.num_prompt_tokens}


def _step_stats(scheduled: SchedulerOutput, updates: list[RequestUpdate], duration: float,
                verified: dict[str, list[int]]) -> StepStats:
    decode, batched = scheduled.num_decode_tokens, scheduled.num_batched_tokens  # a loop over the chunks, a count
    stats = StepStats(num_batched_tokens=batched, num_prefill_tokens=batched - decode, num_decode_tokens=decode,
                      num_scheduled_seqs=len(scheduled.chunks), num_preempted=len(scheduled.preempted_request_ids),
                      num_generated_tokens=len(updates), duration=duration)
    if not scheduled.draft_token_ids:
        return stats
    # speculation: updates may carry several tokens each; count them and what the verifications accepted
    per_pos = [0] * max(map(len, scheduled.draft_token_ids.values()))
    for tokens in verified.values():
        for j in range(len(tokens) - 1):
            per_pos[j] += 1
    return dataclasses.replace(
        stats, num_generated_tokens=sum(len(u.new_token_ids) for u in updates), num_drafts=len(verified),
        num_draft_tokens=sum(len(scheduled.draft_token_ids.get(rid, ())) for rid in verified),
        num_accepted_tokens=sum(per_pos), num_accepted_tokens_per_pos=tuple(per_pos))
