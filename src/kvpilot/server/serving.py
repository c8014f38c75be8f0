"""One request's way through the HTTP layer: validate -> queue slot -> tokenize (timed, in the tokenizer
pool: never on the event loop) -> token cap -> engine -> respond.

Streaming responses abort their request when the client goes away (the generator is closed or cancelled);
non-streaming ones watch for the disconnect message while they wait. Either way the engine frees the blocks
before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse, StreamingResponse

from kvpilot.engine.timeline import RequestMetrics
from kvpilot.outputs import RequestOutput
from kvpilot.server.errors import APIError, from_value_error
from kvpilot.server.messages import AddRequest
from kvpilot.server.prompt_tokens import PromptTooLongError, prompt_size, tokenize_request
from kvpilot.server.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.server.request_identity import engine_request_id
from kvpilot.server.responses import (SSE_DONE, ResponseShape, chat_logprobs, completion_logprobs, usage)
from kvpilot.server.state import ServerState
from kvpilot.server.timings import RequestTimings, access_log_line, kvpilot_field

access_logger = logging.getLogger("kvpilot.access")


class ClientDisconnected(Exception):
    """The client of a non-streaming request left before its answer; the request was aborted."""


@dataclass(frozen=True)
class Prepared:
    """A validated, tokenized request, admitted to the queue."""

    shape: ResponseShape
    message: AddRequest
    tokenize_s: float
    stream: bool
    include_usage: bool
    endpoint: str
    prompt_text: str | None


async def prepare(state: ServerState, body: CompletionRequest | ChatCompletionRequest, arrival: float,
                  client_id: str | None = None) -> Prepared:
    """Validates, takes a queue slot, tokenizes off the event loop; raises APIError (400/404/409/429/503) with
    nothing left behind (the slot is given back on any failure). `client_id`: the client's X-Request-Id
    (request_identity.py), kept in the request id."""
    chat = isinstance(body, ChatCompletionRequest)
    state.check_serving()
    state.check_model(body.model)
    body.check_n()
    request_id = engine_request_id(chat, client_id)
    if state.client.has_request(request_id):
        raise APIError(409, f"a request with X-Request-Id {client_id!r} is still running: send a unique id",
                       param="X-Request-Id")
    try:
        state.admission.reserve(request_id)  # the request cap costs nothing to check: before tokenizing
    except APIError:
        state.metrics.reject("queue_full")
        raise
    try:
        return await _prepare_reserved(state, body, arrival, request_id)
    except BaseException:
        state.admission.release(request_id)
        raise


async def _prepare_reserved(state: ServerState, body: CompletionRequest | ChatCompletionRequest, arrival: float,
                            request_id: str) -> Prepared:
    chat = isinstance(body, ChatCompletionRequest)
    limit = state.info.max_model_len
    started = time.monotonic()
    try:
        prompt = await state.tokenizer_pool.run(prompt_size(body), tokenize_request, body, state.tokenizer,
                                                state.info.vocab_size, limit)
    except PromptTooLongError:
        state.metrics.reject("too_long")
        raise
    tokenize_s = time.monotonic() - started  # includes waiting for a worker: the request waited that long
    state.metrics.observe_tokenization(tokenize_s)
    max_tokens = body.default_max_tokens(limit - prompt.num_tokens)
    if prompt.token_ids is None or prompt.num_tokens + max_tokens > limit:
        state.metrics.reject("too_long")
        raise APIError(400, f"this model's maximum context length is {limit} tokens (max_model_len), but the "
                            f"prompt has {prompt.num_tokens} tokens and max_tokens is {max_tokens} "
                            f"({prompt.num_tokens + max_tokens} in all): shorten the prompt or lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    try:
        num_logprobs = body.num_logprobs() if chat else body.logprobs  # type: ignore[union-attr]
        params = body.sampling_params(max_tokens, num_logprobs)
    except ValueError as exc:
        raise from_value_error(exc) from exc
    try:
        state.admission.commit(request_id, prompt.num_tokens)
    except APIError:
        state.metrics.reject("queue_full")
        raise
    shape = ResponseShape(chat, request_id, body.model or state.args.model_name, int(time.time()))
    message = AddRequest(request_id, prompt.token_ids, params, arrival, body.priority, prompt.text)
    return Prepared(shape, message, tokenize_s, body.stream, body.include_usage,
                    "/v1/chat/completions" if chat else "/v1/completions",
                    (prompt.text or str(body.model_dump().get("messages", ""))) if state.args.log_prompts else None)


class _Finisher:
    """Counts the prompt at the first token; builds the final timings once, observes serialization, writes
    the access log line."""

    def __init__(self, state: ServerState, prepared: Prepared) -> None:
        self.state, self.prepared = state, prepared
        self._prompt_counted = False

    def saw(self, output: RequestOutput) -> None:
        """Every output of the request, in order. The first one with a token comes from the step that
        completed the prefill: the prompt is counted then, once (vLLM's rule; see ServerMetrics)."""
        if not self._prompt_counted and output.outputs[0].token_ids:
            self._prompt_counted = True
            self.state.metrics.observe_prefill_done(len(self.prepared.message.prompt_token_ids))

    def timings(self, final: RequestOutput | None) -> tuple[RequestTimings, RequestMetrics | None]:
        metrics = final.metrics if final is not None and isinstance(final.metrics, RequestMetrics) else None
        timings = RequestTimings.build(arrival=self.prepared.message.arrival_time,
                                       tokenize_s=self.prepared.tokenize_s, metrics=metrics)
        if metrics is not None and metrics.ttft is not None:
            self.state.metrics.observe_serialization(timings.serialize_ms / 1000.0)
        return timings, metrics

    def field(self, final: RequestOutput, timings: RequestTimings, metrics: RequestMetrics | None) -> dict:
        return kvpilot_field(self.prepared.shape.request_id, metrics, len(final.prompt_token_ids), timings)

    def log(self, status: int, timings: RequestTimings, metrics: RequestMetrics | None) -> None:
        p = self.prepared
        access_logger.info(access_log_line(request_id=p.shape.request_id, endpoint=p.endpoint, status=status,
                                           stream=p.stream, metrics=metrics,
                                           num_prompt_tokens=len(p.message.prompt_token_ids), timings=timings,
                                           prompt=p.prompt_text))


def _logprobs(state: ServerState, shape: ResponseShape, output: RequestOutput, num_new: int | None,
              text_offset: int = 0) -> dict | None:
    entries = output.outputs[0].logprobs
    if entries is None:
        return None
    if num_new is not None:
        entries = entries[len(entries) - num_new:] if num_new else []
    return chat_logprobs(entries, state.tokenizer) if shape.chat else \
        completion_logprobs(entries, state.tokenizer, text_offset)


def _raise_item(state: ServerState, item: BaseException) -> None:
    if isinstance(item, ValueError):
        raise from_value_error(item)
    raise APIError(503, str(item), code="engine_failed")


async def respond_whole(state: ServerState, prepared: Prepared,
                        wait_disconnect: Callable[[], Awaitable[None]]) -> JSONResponse:
    """Non-streaming: wait for the final output; abort as soon as the client leaves (`wait_disconnect`
    returns), whether or not outputs are arriving meanwhile."""
    rid = prepared.shape.request_id
    stream = state.client.add(prepared.message)
    finisher = _Finisher(state, prepared)
    final: RequestOutput | None = None
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        while final is None:
            getter = asyncio.ensure_future(stream.get())
            await asyncio.wait((getter, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                raise ClientDisconnected(rid)
            item = getter.result()
            if isinstance(item, BaseException):
                _raise_item(state, item)
            finisher.saw(item)
            if item.finished:
                final = item
    finally:
        watcher.cancel()
        state.admission.release(rid)
        if final is None:
            state.client.abort([rid])
    timings, metrics = finisher.timings(final)
    out = final.outputs[0]
    choice = prepared.shape.choice(out.text, out.finish_reason, _logprobs(state, prepared.shape, final, None),
                                   chunk=False, stop_reason=out.stop_reason)
    body = prepared.shape.body(choice, usage(final), finisher.field(final, timings, metrics))
    finisher.log(200, timings, metrics)
    return JSONResponse(body, headers={"Server-Timing": timings.server_timing_header(), "X-Request-Id": rid})


async def _events(state: ServerState, prepared: Prepared,
                  stream: asyncio.Queue[RequestOutput | BaseException]) -> AsyncIterator[str]:
    shape, rid = prepared.shape, prepared.shape.request_id
    finisher = _Finisher(state, prepared)
    done = False
    text_offset = 0
    try:
        if shape.chat:
            yield shape.role_chunk()
        while not done:
            item = await stream.get()
            if isinstance(item, BaseException):
                done = True
                try:
                    _raise_item(state, item)
                except APIError as exc:
                    yield exc.sse_data()
                break
            finisher.saw(item)
            out = item.outputs[0]
            logprobs = _logprobs(state, shape, item, len(item.delta_token_ids), text_offset)
            text_offset += len(item.delta_text)
            if not item.finished:
                # One chunk per step that produced tokens, even when the detokenizer holds text back (or the
                # model has no tokenizer): clients time tokens by chunks.
                if item.delta_text or item.delta_token_ids:
                    yield shape.chunk([shape.choice(item.delta_text, None, logprobs, chunk=True)])
                continue
            done = True
            timings, metrics = finisher.timings(item)
            field = {"kvpilot": finisher.field(item, timings, metrics)}
            choice = shape.choice(item.delta_text, out.finish_reason, logprobs, chunk=True,
                                  stop_reason=out.stop_reason)
            if prepared.include_usage:
                yield shape.chunk([choice])
                yield shape.chunk([], usage=usage(item), **field)
            else:
                yield shape.chunk([choice], **field)
            yield SSE_DONE
            finisher.log(200, timings, metrics)
    finally:
        state.admission.release(rid)
        if not done:  # client gone (generator closed/cancelled): free the request's blocks now
            state.client.abort([rid])


def respond_stream(state: ServerState, prepared: Prepared) -> StreamingResponse:
    stream = state.client.add(prepared.message)
    return StreamingResponse(_events(state, prepared, stream), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": prepared.shape.request_id})
