"""Lean streaming clients for the benchmarks (imported by server_overhead.py): a closed loop of `concurrency`
streams sending token-id prompts to /v1/completions, counting tokens and content chunks, and its own CPU.

On a small box the client shares the server's cores, so what it spends shows up as server slowdown; a lean one
measures the server. Two clients, measured with 64 streams of a dummy model on the 2-core EPYC family 26:
- `wire_client_run` (the default): one keep-alive connection a stream, an asyncio Protocol that counts SSE
  content chunks in the raw bytes as they arrive (no HTTP or JSON parsing but the status line and the last
  chunk's usage), ~6 us of client CPU a chunk. `run_client` runs it on an event loop that polls its sockets
  at most every MIN_POLL_INTERVAL_S: a server writes a step's chunks to all streams at once, and a client
  woken for each of them would preempt the engine's threads dozens of times a step (each preemption stalls
  the other thread at the next barrier); woken once or twice a step, it reads them all. It delays seeing a
  finished stream, and so the next request, by at most that interval: it can only understate the server;
- `client_run`: aiohttp, ~22 us a chunk (its line reader and response objects); httpx was ~80.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
import selectors
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import aiohttp


@dataclass
class ClientRun:
    """What the client saw: wall seconds, tokens, content chunks (fewer than tokens when the server merged
    steps into one chunk: it fell behind), and the client's own CPU seconds (near the wall time: the client
    itself may be what limits the rate). The server's CPU seconds meanwhile, HTTP process and engine core, are
    filled in after the run, with the engine steps it took."""

    seconds: float
    num_tokens: int
    num_chunks: int
    cpu_seconds: float
    http_cpu_seconds: float = 0.0
    core_cpu_seconds: float = 0.0
    num_steps: int = 0  # the engine's steps meanwhile (from the server's metrics)


async def _one(session: aiohttp.ClientSession, prompt: list[int], output_len: int) -> tuple[int, int]:
    """(completion tokens, content chunks) of one streamed request."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = chunks = 0
    async with session.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:  # one SSE line at a time
            if not line.startswith(b"data: {"):
                continue
            if b'"choices":[]' not in line:  # a content chunk: counted, not parsed (a JSON parse a chunk was
                chunks += 1                  # ~10% of this client's CPU, on the server's cores)
                continue
            usage = json.loads(line[6:]).get("usage")  # the usage chunk: the stream's last, no choices
            tokens = usage["completion_tokens"] if usage else tokens
    return tokens, chunks


async def client_run(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> ClientRun:
    """Streams every prompt, `concurrency` at a time (each stream takes the next prompt when it ends)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def worker() -> tuple[int, int]:
            tokens = chunks = 0
            while not queue.empty():
                one = await _one(session, queue.get_nowait(), output_len)
                tokens, chunks = tokens + one[0], chunks + one[1]
            return tokens, chunks

        start, cpu_start = time.perf_counter(), time.process_time()
        totals = await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ClientRun(time.perf_counter() - start, sum(t for t, _ in totals), sum(c for _, c in totals),
                         time.process_time() - cpu_start)


_CONTENT = b'"choices":[{'  # in every content chunk; the usage chunk's choices are empty
_END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked body (SSE data never holds a raw CR or LF)
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_TAIL_BYTES = 16384  # kept of each response, for its status line and its usage chunk near the end


class _WireStream(asyncio.Protocol):
    """One keep-alive connection; one request on it at a time. Counts content chunks as bytes arrive (a
    pattern split between two reads is still counted once: the carried bytes are shorter than the pattern)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[tuple[int, int]] | None = None
        self.head = b""
        self.tail = b""
        self.carry = b""
        self.num_chunks = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes) -> asyncio.Future[tuple[int, int]]:
        self.done = asyncio.get_running_loop().create_future()
        self.head, self.tail, self.carry, self.num_chunks = b"", b"", b"", 0
        assert self.transport is not None
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        if len(self.head) < 16:
            self.head += data[:16]
        scanned = self.carry + data
        self.num_chunks += scanned.count(_CONTENT)
        self.carry = scanned[-(len(_CONTENT) - 1):]
        self.tail = (self.tail + data)[-_TAIL_BYTES:]
        if self.tail.endswith(_END) and self.done is not None and not self.done.done():
            self._finish()

    def _finish(self) -> None:
        assert self.done is not None
        if not self.head.startswith(b"HTTP/1.1 200"):
            self.done.set_exception(RuntimeError(f"server answered {self.head!r}: {self.tail[-400:]!r}"))
            return
        usage = self.tail.rfind(b'"usage":{')
        match = _COMPLETION_TOKENS.search(self.tail, usage) if usage >= 0 else None
        self.done.set_result((int(match.group(1)) if match else 0, self.num_chunks))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"the server closed the connection mid-response ({exc})"))


def _request_bytes(host: str, prompt: list[int], output_len: int) -> bytes:
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def wire_client_run(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> ClientRun:
    """client_run's closed loop over raw connections (see the module docstring)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "localhost", parts.port or 80
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    loop = asyncio.get_running_loop()

    async def worker() -> tuple[int, int]:
        tokens = chunks = 0
        transport, stream = await loop.create_connection(_WireStream, host, port)
        try:
            while not queue.empty():
                one = await stream.send(_request_bytes(f"{host}:{port}", queue.get_nowait(), output_len))
                tokens, chunks = tokens + one[0], chunks + one[1]
        finally:
            transport.close()
        return tokens, chunks

    start, cpu_start = time.perf_counter(), time.process_time()
    totals = await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ClientRun(time.perf_counter() - start, sum(t for t, _ in totals), sum(c for _, c in totals),
                     time.process_time() - cpu_start)


CLIENTS: dict[str, Callable[..., Any]] = {"wire": wire_client_run, "aiohttp": client_run}
MIN_POLL_INTERVAL_S = 0.002


class _UnhurriedSelector(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
    """Blocks in select() no sooner than `min_interval_s` after its last return (see the module docstring);
    a poll with nothing to wait for (timeout 0: callbacks are ready) is never delayed."""

    def __init__(self, min_interval_s: float) -> None:
        super().__init__()
        self._min_interval_s = min_interval_s
        self._earliest = 0.0

    def select(self, timeout: float | None = None) -> list:
        pause = self._earliest - time.monotonic()
        if pause > 0 and (timeout is None or timeout > 0):
            time.sleep(pause if timeout is None else min(pause, timeout))
        events = super().select(timeout)
        self._earliest = time.monotonic() + self._min_interval_s
        return events


def run_client(name: str, url: str, prompts: list[list[int]], output_len: int, concurrency: int,
               min_poll_interval_s: float = MIN_POLL_INTERVAL_S) -> ClientRun:
    """CLIENTS[name]'s closed loop to its end; "wire" on an unhurried event loop (module docstring)."""
    if name != "wire" or min_poll_interval_s <= 0:
        return asyncio.run(CLIENTS[name](url, prompts, output_len, concurrency))
    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(_UnhurriedSelector(min_poll_interval_s))) \
            as runner:
        return runner.run(wire_client_run(url, prompts, output_len, concurrency))


def _client_process(client: str, url: str, prompts: list[list[int]], output_len: int, concurrency: int,
                    barrier: Any, results: Any) -> None:
    barrier.wait()  # every process has imported and connected nothing yet: start together
    start = time.time()
    run = run_client(client, url, prompts, output_len, concurrency)
    results.put((start, time.time(), run))


def multi_process_client(url: str, prompts: list[list[int]], output_len: int, concurrency: int,
                         num_processes: int, client: str = "wire") -> ClientRun:
    """The same closed loop split over `num_processes` processes (requests and streams dealt round-robin), so
    that one Python client's CPU does not cap the rate. Wall time: the first start to the last end."""
    n = num_processes
    ctx = multiprocessing.get_context("spawn")  # the parent may hold CUDA state from the offline run
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(client, url, prompts[i::n], output_len,
                                                      len(range(i, concurrency, n)), barrier, results))
             for i in range(n)]
    for proc in procs:
        proc.start()
    runs = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    return ClientRun(max(end for _, end, _ in runs) - min(start for start, _, _ in runs),
                     sum(r.num_tokens for _, _, r in runs), sum(r.num_chunks for _, _, r in runs),
                     sum(r.cpu_seconds for _, _, r in runs))
