"""A scripted OpenAI-compatible server whose timings and faults are known (a test double for the bench
and doctor tests).

Each request gets a :class:`Behavior` (from a fixed one or a ``script(index, body)`` function):
TTFT, gaps between tokens, output length, HTTP errors (with ``Retry-After``), dying mid-stream or
sending malformed SSE. Tokens are sent on an absolute schedule from arrival (``ttft_s`` then each
gap), so client measurements can be compared with the truth. Responses carry kvpilot's per-request
``"kvpilot"`` timings field and ``Server-Timing`` header; ``/metrics`` uses vLLM names.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse


@dataclass(frozen=True)
class Behavior:
    """What the server does for one request (times in seconds).

    ``itl_s`` is one gap for all tokens or a tuple cycled over them. ``num_output_tokens`` None
    means the request's ``max_tokens``. ``die_after_tokens`` drops the connection after that many
    tokens; ``malformed_after_tokens`` sends a broken SSE event there.
    """

    ttft_s: float = 0.05
    itl_s: float | tuple[float, ...] = 0.01
    num_output_tokens: int | None = None
    queue_s: float = 0.0
    status: int = 200
    retry_after_s: float | None = None
    die_after_tokens: int | None = None
    malformed_after_tokens: int | None = None
    include_usage: bool = True
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    def gap(self, k: int) -> float:
        """Gap before token k+1 (k >= 0)."""
        return self.itl_s[k % len(self.itl_s)] if isinstance(self.itl_s, tuple) else self.itl_s


Script = Callable[[int, dict[str, Any]], Behavior]


@dataclass(frozen=True)
class ServedRequest:
    """Server-side log entry: arrival on ``time.perf_counter()``, the behavior used, the body."""

    index: int
    arrival: float
    behavior: Behavior
    body: dict[str, Any] = field(repr=False)


class _State:
    def __init__(self) -> None:
        self.slots: asyncio.Semaphore | None = None  # server capacity (max running requests)
        self.running = 0
        self.waiting = 0
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0


def _chunk(chat: bool, model: str, text: str | None, usage: dict[str, int] | None = None,
           extra: dict[str, Any] | None = None) -> str:
    choices = [] if text is None else [
        {"index": 0, "delta": {"content": text}, "finish_reason": None} if chat
        else {"index": 0, "text": text, "finish_reason": None}]
    obj: dict[str, Any] = {"id": "cmpl-scripted", "object": "chat.completion.chunk" if chat
                           else "text_completion", "model": model, "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    obj.update(extra or {})
    return f"data: {json.dumps(obj)}\n\n"


class _Timer:
    """Stamps a request's stages; produces the ``kvpilot`` field (ms)."""

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.queued = self.tokenized = self.first = self.last = arrival

    def field(self, prompt_tokens: int, b: Behavior) -> dict[str, Any]:
        end = time.perf_counter()
        ms = lambda a, z: (z - a) * 1000  # noqa: E731
        return {"request_id": uuid.uuid4().hex[:12], "prompt_tokens": prompt_tokens,
                "cached_tokens": b.num_cached_tokens, "num_preemptions": b.num_preemptions,
                "timings": {"queue_ms": ms(self.arrival, self.queued),
                            "tokenize_ms": ms(self.queued, self.tokenized),
                            "prefill_ms": ms(self.tokenized, self.first),
                            "ttft_ms": ms(self.arrival, self.first),
                            "decode_ms": ms(self.first, self.last),
                            "serialize_ms": ms(self.last, end), "e2e_ms": ms(self.arrival, end)}}


async def _sleep_until(t: float) -> None:
    # uvloop's timers run on a loop time cached at the start of each iteration and rounded to milliseconds,
    # so one sleep can end up to a few ms early on a busy box (a scripted 20 ms TTFT measured 18.9): sleep
    # again until the clock the timings are stamped with says `t`
    while (left := t - time.perf_counter()) > 0:
        await asyncio.sleep(left)


def behavior_from_json(d: dict[str, Any]) -> Behavior:
    d = dict(d)
    if isinstance(d.get("itl_s"), list):
        d["itl_s"] = tuple(d["itl_s"])
    return Behavior(**d)


def build_app(script: Script, model: str, log: list[ServedRequest], old_metric_names: bool = False,
              control: Callable[[tuple[Behavior, ...]], None] | None = None,
              max_running: int | None = None) -> FastAPI:
    """The FastAPI app; ``log`` receives one entry per completion request.

    With ``control``, ``POST /_control/script {"behaviors": [...], "max_running": N}`` replaces the
    script (behaviors cycled by request index; at most N requests decode at once, the rest wait, so
    TTFT then counts from admission) and clears the log; ``GET /_control/log`` returns arrivals.
    """
    app, state = FastAPI(), _State()
    state.slots = asyncio.Semaphore(max_running) if max_running else None

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "scripted"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        usage = "vllm:gpu_cache_usage_perc" if old_metric_names else "vllm:kv_cache_usage_perc"
        preempt = "vllm:num_preemptions"
        lines = [f'vllm:num_requests_running{{model_name="{model}"}} {state.running}',
                 f'vllm:num_requests_waiting{{model_name="{model}"}} {state.waiting}',
                 f'{usage}{{model_name="{model}"}} {min(1.0, state.running / 16):.4f}',
                 f"# TYPE {preempt} counter",
                 f'{preempt}_total{{model_name="{model}"}} {state.preemptions}',
                 "# TYPE vllm:prefix_cache_queries counter",
                 f'vllm:prefix_cache_queries_total{{model_name="{model}"}} {state.prefix_queries}',
                 "# TYPE vllm:prefix_cache_hits counter",
                 f'vllm:prefix_cache_hits_total{{model_name="{model}"}} {state.prefix_hits}']
        return PlainTextResponse("\n".join(lines) + "\n")

    async def handle(request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        body = await request.json()
        index = len(log)
        b = script(index, body)
        log.append(ServedRequest(index, arrival, b, body))
        if b.status != 200:
            headers = {"Retry-After": f"{b.retry_after_s:g}"} if b.retry_after_s is not None else {}
            return JSONResponse({"error": {"message": f"scripted {b.status}", "code": b.status}},
                                status_code=b.status, headers=headers)
        prompt = (" ".join(m.get("content", "") for m in body.get("messages", [])) if chat
                  else str(body.get("prompt", "")))
        num_prompt = len(prompt.split())
        num_out = b.num_output_tokens if b.num_output_tokens is not None else int(body.get("max_tokens", 16))
        timer = _Timer(arrival)
        state.prefix_queries += num_prompt
        state.prefix_hits += min(num_prompt, b.num_cached_tokens)
        state.preemptions += b.num_preemptions
        if body.get("stream"):
            gen = _stream(b, chat, model, timer, state, num_prompt, num_out)
            return StreamingResponse(gen, media_type="text/event-stream")
        return await _whole(b, chat, model, timer, state, num_prompt, num_out)

    if control is not None:
        @app.post("/_control/script")
        async def set_script(request: Request) -> dict[str, Any]:
            spec = await request.json()
            control(tuple(behavior_from_json(b) for b in spec["behaviors"]))
            cap = spec.get("max_running")
            state.slots = asyncio.Semaphore(int(cap)) if cap else None
            log.clear()
            return {"ok": True}

        @app.get("/_control/log")
        async def get_log() -> list[dict[str, Any]]:
            return [{"index": r.index, "arrival": r.arrival, "max_tokens": r.body.get("max_tokens"),
                     "stream": r.body.get("stream")} for r in log]

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    return app


async def _token_schedule(b: Behavior, timer: _Timer, state: _State, num_out: int) -> AsyncIterator[int]:
    """Yields token numbers at arrival + ttft + gaps; stamps queue/tokenize/first/last."""
    state.waiting += 1
    await _sleep_until(timer.arrival + b.queue_s)
    if state.slots is not None:
        await state.slots.acquire()
    state.waiting -= 1
    state.running += 1
    timer.queued = timer.tokenized = time.perf_counter()
    due = timer.queued + b.ttft_s - b.queue_s if state.slots is not None else timer.arrival + b.ttft_s
    try:
        for k in range(num_out):
            await _sleep_until(due)
            timer.last = time.perf_counter()
            if k == 0:
                timer.first = timer.last
            yield k
            due += b.gap(k)
    finally:
        state.running -= 1
        if state.slots is not None:
            state.slots.release()


async def _stream(b: Behavior, chat: bool, model: str, timer: _Timer, state: _State,
                  num_prompt: int, num_out: int) -> AsyncIterator[str]:
    async for k in _token_schedule(b, timer, state, num_out):
        if b.die_after_tokens is not None and k >= b.die_after_tokens:
            raise ConnectionAbortedError("scripted: dying mid-stream")  # uvicorn drops the connection
        if b.malformed_after_tokens is not None and k >= b.malformed_after_tokens:
            yield "data: {this is not json\n\n"
            return
        yield _chunk(chat, model, f" t{k}")
    usage = {"prompt_tokens": num_prompt, "completion_tokens": num_out,
             "total_tokens": num_prompt + num_out}
    yield _chunk(chat, model, None, usage if b.include_usage else None,
                 {"kvpilot": timer.field(num_prompt, b)})
    yield "data: [DONE]\n\n"


async def _whole(b: Behavior, chat: bool, model: str, timer: _Timer, state: _State,
                 num_prompt: int, num_out: int) -> Response:
    text = "".join([f" t{k}" async for k in _token_schedule(b, timer, state, num_out)])
    choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
    kv = timer.field(num_prompt, b)
    t = kv["timings"]
    header = ", ".join(f"{k};dur={t[k + '_ms']:.3f}" for k in ("queue", "tokenize", "prefill", "decode", "serialize"))
    obj = {"id": "cmpl-scripted", "model": model, "choices": [choice], "kvpilot": kv,
           "usage": {"prompt_tokens": num_prompt, "completion_tokens": num_out,
                     "total_tokens": num_prompt + num_out}}
    return JSONResponse(obj, headers={"Server-Timing": header})


class ScriptedServer:
    """Runs the app with uvicorn in a daemon thread on 127.0.0.1 and a free port.

    Use as a context manager; ``log`` lists served completion requests in arrival order.
    """

    def __init__(self, script: Script | Behavior = Behavior(), model: str = "scripted-model",
                 old_metric_names: bool = False, log_level: str = "critical",
                 max_running: int | None = None) -> None:
        self.script: Script = (lambda i, body: script) if isinstance(script, Behavior) else script
        self.model = model
        self.log: list[ServedRequest] = []
        app = build_app(lambda i, body: self.script(i, body), model, self.log, old_metric_names,
                        max_running=max_running)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ScriptedServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("scripted server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cycled(behaviors: tuple[Behavior, ...]) -> Script:
    """Script giving request i the behavior ``behaviors[i % len]``."""
    return lambda i, body: behaviors[i % len(behaviors)]

