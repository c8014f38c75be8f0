"""Lean streaming clients for the benchmarks (imported by server_overhead.py): a closed loop of `concurrency`
streams sending token-id prompts to /v1/completions, counting tokens and content chunks, and its own CPU.

On a small box the client shares the server's cores, so what it spends shows up as server slowdown; a lean one
measures the server. Two clients (`run_client`), measured with 64 streams of a dummy model on the 2-core EPYC
family 26:
- "wire" (the default; wire_client.py): raw sockets on one epoll loop, chunks counted in the bytes, polled at
  most every MIN_POLL_INTERVAL_S;
- "aiohttp" (`client_run`): ~22 us of client CPU a chunk (its line reader and response objects); httpx was ~80.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from wire_client import request_body, wire_run


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
    core_preemptions: int = 0  # its threads switched out while runnable (server_overhead.preemptions)


async def _one(session: aiohttp.ClientSession, prompt: list[int], output_len: int) -> tuple[int, int]:
    """(completion tokens, content chunks) of one streamed request."""
    tokens = chunks = 0
    async with session.post("/v1/completions", json=request_body(prompt, output_len)) as response:
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


CLIENTS = ("wire", "aiohttp")
MIN_POLL_INTERVAL_S = 0.002


def run_client(name: str, url: str, prompts: list[list[int]], output_len: int, concurrency: int,
               min_poll_interval_s: float = MIN_POLL_INTERVAL_S) -> ClientRun:
    """The closed loop of client `name` (CLIENTS) to its end."""
    if name == "aiohttp":
        return asyncio.run(client_run(url, prompts, output_len, concurrency))
    seconds, num_tokens, num_chunks, cpu_seconds = wire_run(url, prompts, output_len, concurrency,
                                                            min_poll_interval_s)
    return ClientRun(seconds, num_tokens, num_chunks, cpu_seconds)


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
