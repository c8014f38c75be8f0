"""Send one request to an OpenAI-compatible endpoint and time it (TTFT, every chunk gap, E2E).

Failures never raise: they come back as an :class:`Outcome` with an ``error_kind`` of
``http_status`` (with status), ``connect_error``, ``timeout``, ``stream_incomplete`` (the server
stopped mid-stream), ``malformed_sse``, ``stream_error`` (an error object inside the stream),
``bad_response`` or ``transport_error``.

Requests go through aiohttp (scrapes of /metrics through httpx, elsewhere): on a small box the client shares the
server's cores, and aiohttp's C-accelerated stream reading costs about a third of httpx's client CPU a streamed
chunk (~26 vs ~80 us at 64 streams on a 2-core EPYC family 26), so a load generator on the same box measures
the server more and itself less.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from kvpilot.bench.breakdown import parse_kvpilot_field, timings_from_header
from kvpilot.bench.records import ServerTimings
from kvpilot.bench.sse import SseParser

Endpoint = Literal["completions", "chat"]
MAX_ERROR_BODY = 300
MAX_RESENDS = 3  # sends of a request whose connection broke before any answer, after the first
REPLICA_HEADER = "x-kvpilot-replica"  # names the replica that served a response (kvpilot's Ray Serve app)


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    api_key: str | None = None
    stream: bool = True
    ignore_eos: bool = False
    timeout_s: float = 300.0
    temperature: float | None = None  # None: the server's default (OpenAI's is 1.0)

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class Outcome:
    """Raw result of one HTTP exchange; times are ``time.perf_counter()`` seconds."""

    t_sent: float
    status: int | None = None
    error_kind: str | None = None
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)
    t_end: float | None = None
    text: str = ""
    usage: dict[str, Any] | None = None
    server: ServerTimings | None = None
    retry_after_s: float | None = None
    replica: str | None = None  # the REPLICA_HEADER of the response, when it has one
    server_prompt_ms: float | None = None  # llama-server's timings.prompt_ms (engine_prompt_ms)

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.status == 200


def build_payload(target: Target, prompt: str | None, messages: list[dict[str, str]] | None,
                  max_tokens: int) -> dict[str, Any]:
    """The request body; asks for ``usage`` in the stream so output counts come from the server."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "stream": target.stream}
    if target.endpoint == "chat":
        body["messages"] = messages if messages is not None else [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt if prompt is not None else "\n".join(m["content"] for m in messages or [])
    if target.stream:
        body["stream_options"] = {"include_usage": True}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.temperature is not None:
        body["temperature"] = target.temperature
    return body


def open_session(target: Target) -> aiohttp.ClientSession:
    """The session a run sends its requests through (inside the running event loop): no cap on connections
    (the load shape bounds them), keep-alive, and ``target.timeout_s`` for connecting and for every read, as
    httpx's timeout applied; proxies from the environment, as httpx honours them."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=target.timeout_s, sock_read=target.timeout_s)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout, trust_env=True)


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    try:
        return float(resp.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def _delta_text(obj: dict[str, Any]) -> str | None:
    """Text of the first choice (completions ``text`` or chat ``delta.content``); None if no choice."""
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or choice.get("message") or {}
    if not isinstance(delta, dict):
        return ""
    # Reasoning models stream their thinking first; it is output too (TTFT counts from it).
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def engine_prompt_ms(obj: dict[str, Any]) -> float | None:
    """How long the server says the request's prompt took, from its first batch to its last: llama-server's
    ``timings.prompt_ms`` (on the final chunk or response). It leaves out any wait before the prompt ran (for a
    slot, or for the running batch). None when absent."""
    timings = obj.get("timings")
    value = timings.get("prompt_ms") if isinstance(timings, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def _handle_event(out: Outcome, data: str, now: float) -> bool:
    """Apply one SSE payload to ``out``; returns True at ``[DONE]``."""
    if data.strip() == "[DONE]":
        return True
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        out.error_kind, out.error = "malformed_sse", f"SSE data is not JSON: {data[:80]!r}"
        return True
    if not isinstance(obj, dict):
        out.error_kind, out.error = "malformed_sse", f"SSE data is not a JSON object: {data[:80]!r}"
        return True
    if "error" in obj:
        out.error_kind, out.error = "stream_error", str(obj["error"])[:MAX_ERROR_BODY]
        return True
    text = _delta_text(obj)
    if text:  # a chunk that carries output: TTFT and ITL are taken on these
        out.chunk_times.append(now)
        out.text += text
    if obj.get("usage"):
        out.usage = obj["usage"]
    out.server = parse_kvpilot_field(obj) or out.server
    out.server_prompt_ms = engine_prompt_ms(obj) or out.server_prompt_ms
    return False


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome) -> None:
    parser, done = SseParser(), False
    async for chunk in resp.content.iter_any():  # whatever arrived: the parser joins events split across reads
        now = time.perf_counter()
        for data in parser.feed(chunk):
            done = _handle_event(out, data, now)
            if done:
                break
        if done:
            break
    for data in ([] if done else parser.flush()):
        done = _handle_event(out, data, time.perf_counter())
    out.t_end = time.perf_counter()
    if not done and out.error_kind is None:
        out.error_kind, out.error = "stream_incomplete", "stream ended without [DONE]"


async def _read_json(resp: aiohttp.ClientResponse, out: Outcome) -> None:
    raw = await resp.read()
    out.t_end = time.perf_counter()
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        out.error_kind, out.error = "bad_response", f"response is not JSON: {raw[:80]!r}"
        return
    out.text = _delta_text(obj) or ""
    out.usage = obj.get("usage")
    out.server = parse_kvpilot_field(obj) or timings_from_header(resp.headers.get("server-timing"))
    out.server_prompt_ms = engine_prompt_ms(obj)


async def execute(session: aiohttp.ClientSession, target: Target, payload: dict[str, Any]) -> Outcome:
    """POST ``payload`` and measure it. Never raises for server or network faults. A request whose connection
    broke before any answer (a kept-alive connection the server had closed: llama.cpp's server does so under
    load, several at once at 64 streams) is sent again, at most MAX_RESENDS times, each on the next connection
    the pool gives; its times still count from the first send."""
    out = Outcome(t_sent=time.perf_counter())
    for resend in range(MAX_RESENDS + 1):
        if not await _exchange(session, target, payload, out) or resend == MAX_RESENDS:
            break
        out.error_kind = out.error = None
    if out.t_end is None:
        out.t_end = time.perf_counter()
    return out


async def _exchange(session: aiohttp.ClientSession, target: Target, payload: dict[str, Any], out: Outcome) -> bool:
    """One POST into ``out``; True when the connection broke before the server answered anything."""
    try:
        async with session.post(target.url, json=payload, headers=target.headers()) as resp:
            out.status = resp.status
            out.replica = resp.headers.get(REPLICA_HEADER)
            if resp.status != 200:
                body = (await resp.read())[:MAX_ERROR_BODY].decode("utf-8", errors="replace")
                out.error_kind, out.error = "http_status", f"HTTP {resp.status}: {body}"
                out.retry_after_s = _retry_after(resp)
            elif target.stream:
                await _read_stream(resp, out)
            else:
                await _read_json(resp, out)
    except aiohttp.ClientConnectorError as exc:
        out.error_kind, out.error = "connect_error", f"cannot connect to {target.url}: {exc}"
    except asyncio.TimeoutError as exc:  # aiohttp's connect and read timeouts are TimeoutErrors
        out.error_kind, out.error = "timeout", f"no answer within {target.timeout_s}s ({type(exc).__name__})"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        out.error_kind = "stream_incomplete" if out.status == 200 else "transport_error"
        out.error = f"connection broke: {exc or type(exc).__name__}"
        return out.status is None
    except aiohttp.ClientError as exc:
        out.error_kind, out.error = "transport_error", f"{type(exc).__name__}: {exc}"
    return False
