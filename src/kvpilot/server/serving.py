"""One request's way through the HTTP layer: validate -> queue slot -> grammar admission (an output
constraint compiled and probed, structured_outputs/admission.py) -> tokenize (timed; both in the tokenizer
pool: never on the event loop) -> token cap -> engine -> respond.

Streaming responses abort their request when the client goes away (the generator is closed or cancelled);
non-streaming ones watch for the disconnect message while they wait. Either way the engine frees the blocks
before its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Send

from kvpilot.engine.kv_transfer import KVTransferParamsError, KVTransferRequest, check_role, parse_kv_transfer_params
from kvpilot.outputs import RequestOutput
from kvpilot.sampling_params import SamplingParams
from kvpilot.server.observe.collector import Collector
from kvpilot.server.core.engine_client import Item
from kvpilot.server.openai.chat_output import chat_output_for
from kvpilot.server.openai.errors import APIError, from_value_error
from kvpilot.server.fanout import FanoutShape, check_size, choose, id_in_use, sub_seed
from kvpilot.server.item_stream import ItemStream
from kvpilot.server.core.messages import AddRequest
from kvpilot.server.prepared import Prepared
from kvpilot.server.openai.prompt_batch import num_prompts, prompt_bodies, tokenize_prompts
from kvpilot.server.prompt_tokens import PromptTooLongError, TokenizedPrompt, prompt_size, tokenize_request
from kvpilot.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.server.push_stream import ChunkPusher, can_push
from kvpilot.server.request_identity import engine_request_id
from kvpilot.server.openai.responses import SSE_DONE, ResponseShape, chat_logprobs, completion_logprobs
from kvpilot.server.state import ServerState
from kvpilot.server.sub_requests import SubRequests
from kvpilot.structured_outputs import StructuredOutputsError


class ClientDisconnected(Exception):
    """The client of a non-streaming request left before its answer; the request was aborted."""


async def prepare(state: ServerState, body: CompletionRequest | ChatCompletionRequest, arrival: float,
                  client_id: str | None = None) -> Prepared:
    """Validates, takes a queue slot per sub-request, tokenizes off the event loop; raises APIError
    (400/404/409/429/503) with nothing left behind (the slots are given back on any failure). `client_id`: the
    client's X-Request-Id (request_identity.py), kept in the request id."""
    chat = isinstance(body, ChatCompletionRequest)
    state.check_serving()
    state.check_model(body.model)
    body.check_fields()
    fanout = FanoutShape(num_prompts(body), body.n, body.candidates_per_prompt())
    check_size(fanout, state.admission.limits.max_num_queued_reqs)
    _kv_transfer(state, body, fanout)  # 400 before anything is reserved
    request_id = engine_request_id(chat, client_id)
    sub_ids = [fanout.sub_request_id(request_id, k) for k in range(fanout.size)]
    # From its arrival (a slot held while it is tokenized) to its end (a stream in the engine client), both
    # ways round: `dup` fanned out into `cmpl-dup-0`.. is in flight for a second `dup`, and the reverse.
    live = (*state.admission.request_ids(), *state.client.request_ids())
    if any(id_in_use(rid, live) for rid in {request_id, *sub_ids}):
        raise APIError(409, f"a request with X-Request-Id {client_id!r} is still running: send a unique id",
                       param="X-Request-Id")
    try:
        for rid in sub_ids:  # the request cap costs nothing to check: before tokenizing
            state.admission.reserve(rid)
    except APIError:
        for rid in sub_ids:
            state.admission.release(rid)
        state.metrics.reject("queue_full")
        raise
    try:
        return await _prepare_reserved(state, body, arrival, request_id, fanout, sub_ids)
    except BaseException:
        for rid in sub_ids:
            state.admission.release(rid)
        raise


async def _prepare_reserved(state: ServerState, body: CompletionRequest | ChatCompletionRequest, arrival: float,
                            request_id: str, fanout: FanoutShape, sub_ids: list[str]) -> Prepared:
    chat = isinstance(body, ChatCompletionRequest)
    limit = state.info.max_model_len
    bodies = prompt_bodies(body)
    echo = bool(getattr(body, "echo", False))
    await _admit_grammar(state, body)
    started = time.monotonic()
    try:
        # tokenize_request is read from this module at each call: tests wrap it (held_tokenizer.py).
        prompts = await state.tokenizer_pool.run(sum(prompt_size(b) for b in bodies), tokenize_prompts,
                                                 tokenize_request, bodies, state.tokenizer, state.info.vocab_size,
                                                 limit, echo)
    except PromptTooLongError:
        state.metrics.reject("too_long")
        raise
    tokenize_s = time.monotonic() - started  # includes waiting for a worker: the request waited that long
    state.metrics.observe_tokenization(tokenize_s)
    user_logprobs = body.num_logprobs() if chat else body.logprobs  # type: ignore[union-attr]
    # best_of ranks candidates by cumulative logprob: the engine must report the sampled tokens' logprobs.
    engine_logprobs = 0 if user_logprobs is None and fanout.ranked else user_logprobs
    output = chat_output_for(body, state.reasoning_parser(),  # type: ignore[arg-type]
                             prompts[0][0].chat_tail) if chat else None
    messages: list[AddRequest] = []
    for k, rid in enumerate(sub_ids):
        prompt, _ = prompts[fanout.prompt_of(k)]
        if fanout.is_leader(k):
            params = _prompt_params(state, body, prompt, engine_logprobs, limit)
            if output is not None and output.harmony:  # the reading needs the markers, and strips them all
                params = dataclasses.replace(params, skip_special_tokens=False)
        sub_params = params if fanout.candidate_of(k) == 0 or params.seed is None else \
            dataclasses.replace(params, seed=sub_seed(params.seed, fanout.candidate_of(k)))
        messages.append(AddRequest(rid, list(prompt.token_ids or ()), sub_params, arrival, body.priority,
                                   prompt.text, _kv_transfer(state, body, fanout)))
    try:
        for message in messages:
            state.admission.commit(message.request_id, len(message.prompt_token_ids))
    except APIError:
        state.metrics.reject("queue_full")
        raise
    shape = ResponseShape(chat, request_id, body.model or state.args.model_name, int(time.time()))
    texts = tuple((p.text or str(body.model_dump().get("messages", ""))) if state.args.log_prompts else None
                  for p, _ in prompts)
    return Prepared(shape, tuple(messages), tokenize_s, body.stream, body.include_usage,
                    "/v1/chat/completions" if chat else "/v1/completions", texts[0], fanout=fanout,
                    echo=tuple(text for _, text in prompts), show_logprobs=user_logprobs is not None,
                    stage_followers=state.info.enable_prefix_caching, prompt_texts=texts, chat_output=output)


def _kv_transfer(state: ServerState, body: CompletionRequest | ChatCompletionRequest,
                 fanout: FanoutShape) -> KVTransferRequest | None:
    """The request's kv_transfer_params, parsed and allowed by this worker's --kv-role; 400 naming the field."""
    try:
        transfer = parse_kv_transfer_params(body.kv_transfer_params)
        if transfer is not None:
            check_role(transfer, state.info.kv_role or None)
    except KVTransferParamsError as exc:
        raise APIError(400, str(exc), param="kv_transfer_params") from None
    if transfer is not None and fanout.size > 1:
        raise APIError(400, "kv_transfer_params serves one prompt and one choice: send n=1 and a single prompt",
                       param="kv_transfer_params")
    return transfer


async def _admit_grammar(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> None:
    """The request's output constraint compiled and probed for the model's tokenizer (GrammarAdmission) in the
    tokenizer pool, never on the event loop; a grammar that would fail or stall in the engine is a 400 naming
    the field and the limit."""
    constraint = body.structured_outputs_constraint()
    if constraint is None:
        return
    param, spec = constraint
    try:
        await state.tokenizer_pool.run(spec.num_chars, state.grammar_admission().admit, spec)
    except StructuredOutputsError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None


def _prompt_params(state: ServerState, body: CompletionRequest | ChatCompletionRequest, prompt: TokenizedPrompt,
                   num_logprobs: int | None, limit: int) -> SamplingParams:
    """The SamplingParams of one prompt (its max_tokens may depend on its length); 400 when the prompt and
    max_tokens do not fit max_model_len."""
    max_tokens = body.default_max_tokens(limit - prompt.num_tokens, state.args.max_tokens_default)
    if prompt.token_ids is None or prompt.num_tokens + max_tokens > limit:
        state.metrics.reject("too_long")
        raise APIError(400, f"this model's maximum context length is {limit} tokens (max_model_len), but the "
                            f"prompt has {prompt.num_tokens} tokens and max_tokens is {max_tokens} "
                            f"({prompt.num_tokens + max_tokens} in all): shorten the prompt or lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    try:
        return body.sampling_params(max_tokens, num_logprobs)
    except ValueError as exc:
        raise from_value_error(exc) from exc


def _logprobs(state: ServerState, prepared: Prepared, output: RequestOutput, new: slice | None,
              text_offset: int = 0) -> dict | None:
    """`new`: the chunk's tokens by position (None: all). By position, not "the last n": a running output's
    logprobs list is live and may already hold later steps' entries that the stream has not reached."""
    entries = output.outputs[0].logprobs
    if entries is None or not prepared.show_logprobs:
        return None
    if new is not None:
        entries = entries[new]
    return chat_logprobs(entries, state.tokenizer) if prepared.shape.chat else \
        completion_logprobs(entries, state.tokenizer, text_offset)


def _raise_item(state: ServerState, item: BaseException) -> None:
    if isinstance(item, ValueError):
        raise from_value_error(item)
    raise APIError(503, str(item), code="engine_failed")


async def respond_whole(state: ServerState, prepared: Prepared,
                        wait_disconnect: Callable[[], Awaitable[None]]) -> JSONResponse:
    """Non-streaming: wait for every sub-request's final output; abort them all as soon as the client leaves
    (`wait_disconnect` returns), whether or not outputs are arriving meanwhile, or one of them fails."""
    rid, shape, fanout = prepared.shape.request_id, prepared.shape, prepared.fanout
    subs = SubRequests(state.client, fanout, prepared.messages, prepared.stage_followers)
    collector = Collector(state, prepared)
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        subs.start()
        while collector.remaining:
            getter = asyncio.ensure_future(subs.get())
            await asyncio.wait((getter, watcher), return_when=asyncio.FIRST_COMPLETED)
            # The watcher first: when outputs are always waiting, the getter finishes in the same round every
            # time, and a client that left would otherwise be noticed only when its request ends.
            if watcher.done():
                getter.cancel()
                raise ClientDisconnected(rid)
            k, item = getter.result()
            if isinstance(item, BaseException):
                _raise_item(state, item)
            collector.saw(k, item)
    finally:
        watcher.cancel()
        for sub_id in prepared.request_ids:
            state.admission.release(sub_id)
        subs.close()  # aborts whatever still runs (client gone, or a sibling failed)
    timings, usage, field = collector.finish()
    finals = [f for f in collector.finals if f is not None]
    choices = []
    for index, k in choose(fanout, finals):
        out = finals[k].outputs[0]
        text = prepared.echo[fanout.prompt_of(k)] + out.text
        choice = shape.choice(text, out.finish_reason, _logprobs(state, prepared, finals[k], None),
                              chunk=False, stop_reason=out.stop_reason, index=index)
        output = prepared.chat_output
        choices.append(output.shape_message(choice, out.text, out.finish_reason) if output else choice)
    body = shape.body(choices, usage, field)
    if finals[0].kv_transfer_params is not None:  # a prefill request: where the decode worker pulls its KV
        body["kv_transfer_params"] = finals[0].kv_transfer_params
    collector.log(200)
    return JSONResponse(body, headers={"Server-Timing": timings.server_timing_header(), "X-Request-Id": rid})


async def _events(state: ServerState, prepared: Prepared, subs: SubRequests,
                  collector: Collector) -> AsyncIterator[str]:
    """SSE for every sub-request; choice k is sub-request k (streams never rank: best_of > n is refused). The
    running outputs a ChunkPusher sent never come here: it pushes only where the per-choice state below
    (offsets, tokens sent, echo, tool calls and reasoning) is unused."""
    shape, fanout, output = prepared.shape, prepared.fanout, prepared.chat_output
    text_offsets = [0] * fanout.size
    num_tokens_sent = [0] * fanout.size
    streams = [output.stream() for _ in range(fanout.size)] if output else []  # tool calls, reasoning
    echo_pending = [bool(prepared.echo[fanout.prompt_of(k)]) for k in range(fanout.size)]
    try:
        if shape.chat:
            for k in range(fanout.size):
                yield shape.role_chunk(k)
        while collector.remaining:
            k, item = await subs.get()
            if isinstance(item, BaseException):
                try:
                    _raise_item(state, item)
                except APIError as exc:
                    yield exc.sse_data()
                break
            collector.saw(k, item)
            out = item.outputs[0]
            new = slice(num_tokens_sent[k], num_tokens_sent[k] + len(item.delta_token_ids))
            num_tokens_sent[k] = new.stop
            logprobs = _logprobs(state, prepared, item, new, text_offsets[k])
            text_offsets[k] += len(item.delta_text)
            text = item.delta_text
            if echo_pending[k] and (item.finished or item.delta_text or item.delta_token_ids):
                text, echo_pending[k] = prepared.echo[fanout.prompt_of(k)] + text, False  # the choice's first chunk
            if not item.finished:
                # One chunk per step that produced tokens, even when the detokenizer holds text back (or the
                # model has no tokenizer): clients time tokens by chunks.
                if (item.delta_text or item.delta_token_ids) and output is None:
                    yield shape.running_chunk(text, logprobs, k)
                elif output is not None and (item.delta_text or logprobs is not None):
                    delta = streams[k].running(out.text) if item.delta_text else None
                    if delta is not None or logprobs is not None:  # held-back text: its logprobs still go
                        choice = shape.choice("", None, logprobs, chunk=True, index=k)
                        yield shape.chunk([{**choice, "delta": delta or {}}])
                continue
            choice = shape.choice(text, out.finish_reason, logprobs, chunk=True, stop_reason=out.stop_reason,
                                  index=k)
            if output is not None:  # the text held back (all of a forced call's): in this chunk
                choice = streams[k].final(choice, out.text, out.finish_reason)
            if collector.remaining:  # another choice still runs: this one's finish chunk alone
                yield shape.chunk([choice])
                continue
            timings, usage, field = collector.finish()
            # a prefill request sent with stream: true gets its kv_transfer_params in the last chunk
            transfer = {"kv_transfer_params": item.kv_transfer_params} if item.kv_transfer_params else {}
            if prepared.include_usage:
                yield shape.chunk([choice])
                yield shape.chunk([], usage=usage, kvpilot=field, **transfer)
            else:
                yield shape.chunk([choice], kvpilot=field, **transfer)
            yield SSE_DONE
            collector.log(200)
    finally:
        for sub_id in prepared.request_ids:
            state.admission.release(sub_id)
        subs.close()  # client gone (generator closed/cancelled) or a failure: free the blocks now


def respond_stream(state: ServerState, prepared: Prepared) -> StreamingResponse:
    subs = SubRequests(state.client, prepared.fanout, prepared.messages, prepared.stage_followers)
    subs.start()
    collector = Collector(state, prepared)
    events = _events(state, prepared, subs, collector)
    headers = {"Cache-Control": "no-cache", "X-Request-Id": prepared.shape.request_id}
    stream = subs.lone_stream
    if stream is None or not can_push(prepared):
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    return _PushingResponse(events, stream, ChunkPusher(prepared.shape, collector), headers)


class _PushingResponse(StreamingResponse):
    """A StreamingResponse whose running chunks the engine client's delivery may send itself (push_stream.py);
    the rest (the first and final chunks, disconnects) as StreamingResponse does."""

    def __init__(self, events: AsyncIterator[str], stream: ItemStream[Item], pusher: ChunkPusher,
                 headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._stream, self._pusher = stream, pusher

    async def stream_response(self, send: Send) -> None:
        self._pusher.start(send)
        self._stream.set_push(self._pusher.push)
        try:
            await super().stream_response(self._pusher.send)
        finally:
            self._stream.set_push(None)
            self._pusher.stop()
