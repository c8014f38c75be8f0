"""The measured load split over several client processes, so that one Python event loop's CPU does not cap it.

One process reads a few thousand streamed chunks a second; hundreds of fast streams (a GPU server at 256
concurrent decodes makes ~15,000 tokens/s) need more, or the client's own lag is measured as the server's.
With ``num_processes`` = N, process i runs the same request loop (request_loop.py) on share i of the load:

* closed loop: concurrency and the request budget dealt round-robin (process i gets every N-th slot);
* open loop: rate / N each with its own arrival seed (the sum of N independent Poisson processes at rate
  r / N is a Poisson process at r), ``max_concurrency`` dealt like concurrency; a trace's items are dealt
  round-robin and keep their arrival times;
* items dealt round-robin (all of them to each when there are fewer items than processes).

The processes start together (a barrier, after their imports) and time their records against the parent's
``t0`` (perf_counter is the system-wide monotonic clock). Records stream back as they complete (the progress
bar advances); the parent renumbers them in the order they were sent. Warmup and metric scrapes stay in the
parent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import multiprocessing
import queue
import time
from dataclasses import dataclass
from typing import Any

from kvpilot.bench.client import Target, open_session
from kvpilot.bench.load import LoadShape
from kvpilot.bench.records import RequestRecord, WorkItem
from kvpilot.bench.request_loop import OnRecord, RequestLoop, probe_loop_lag

START_TIMEOUT_S = 120.0  # a process imports aiohttp and numpy (and loads its tokenizer) before the barrier
POLL_S = 0.5


class ClientProcessError(RuntimeError):
    """A client process failed or died; the message says which and why."""


@dataclass(frozen=True)
class ProcessPlan:
    """``tokenizer_spec``: what ``load_tokenizer`` takes; each process loads its own (tokenizers are not sent
    between processes)."""

    num_processes: int
    tokenizer_spec: Any = None


def num_processes_for(shape: LoadShape, requested: int) -> int:
    """The processes a run can use: at most one per concurrent stream and per request (a sweep's
    synchronous run, one stream, runs in one process whatever was asked)."""
    limits = [v for v in (shape.concurrency, shape.num_requests) if v is not None]
    return max(1, min([requested, *limits]))


def _deal(total: int | None, n: int, i: int) -> int | None:
    return None if total is None else len(range(i, total, n))


def split_shape(shape: LoadShape, n: int, i: int) -> LoadShape:
    """Process i's share of ``shape`` (no warmup: the parent ran it). Raises ValueError when a share would be
    empty (more processes than concurrency or requests)."""
    most = num_processes_for(shape, n)
    if most < n:
        raise ValueError(f"--client-processes {n} is more than the load's {most} concurrent streams or "
                         f"requests: use at most {most} processes")
    rate = shape.request_rate / n if math.isfinite(shape.request_rate) else shape.request_rate
    max_concurrency = None if shape.max_concurrency is None else max(1, _deal(shape.max_concurrency, n, i) or 0)
    return dataclasses.replace(shape, concurrency=_deal(shape.concurrency, n, i), request_rate=rate,
                               max_concurrency=max_concurrency, num_requests=_deal(shape.num_requests, n, i),
                               num_warmup=0, seed=shape.seed + i)


def split_items(items: list[WorkItem], n: int, i: int) -> list[WorkItem]:
    return items[i::n] if len(items) >= n else list(items)


async def _process_load(target: Target, items: list[WorkItem], shape: LoadShape, tok: Any,
                        routes: tuple[Target, ...], t0: float, out: Any) -> list[tuple[float, float]]:
    async with open_session(target) as session:
        run = RequestLoop(session, target, shape, tok, lambda rec: out.put(("record", rec)), routes, t0=t0)
        stop, lag = asyncio.Event(), list[tuple[float, float]]()
        probe = asyncio.create_task(probe_loop_lag(stop, t0, lag))
        await run.run_measured(items)
        stop.set()
        await probe
    return lag


def _process_main(target: Target, items: list[WorkItem], shape: LoadShape, tokenizer_spec: Any,
                  routes: tuple[Target, ...], t0: float, barrier: Any, out: Any) -> None:
    """A client process: load the tokenizer, wait for the others, run its share, report."""
    try:
        from kvpilot.bench.tokens import load_tokenizer  # noqa: PLC0415

        tok = load_tokenizer(tokenizer_spec)
        barrier.wait(START_TIMEOUT_S)
        lag = asyncio.run(_process_load(target, items, shape, tok, routes, t0, out))
        out.put(("done", lag))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        out.put(("error", f"{type(exc).__name__}: {exc}"))
        barrier.abort()  # a failure before the start: the parent stops waiting at once


async def run_in_processes(plan: ProcessPlan, target: Target, items: list[WorkItem], shape: LoadShape,
                           routes: tuple[Target, ...], t0: float,
                           on_record: OnRecord | None) -> tuple[list[RequestRecord], list[tuple[float, float]], float]:
    """(records renumbered in send order, every process's loop-lag samples, wall seconds from the common start
    to the last process's end). Raises ClientProcessError if a process fails or dies."""
    n = plan.num_processes
    shares = [split_shape(shape, n, i) for i in range(n)]
    ctx = multiprocessing.get_context("spawn")  # no fork: the parent may hold threads, CUDA, a tokenizer
    barrier, out = ctx.Barrier(n + 1), ctx.Queue()
    procs = [ctx.Process(target=_process_main, daemon=True, name=f"kvpilot-bench-client-{i}",
                         args=(target, split_items(items, n, i), shares[i], plan.tokenizer_spec, routes, t0,
                               barrier, out)) for i in range(n)]
    for proc in procs:
        proc.start()
    try:
        await asyncio.to_thread(barrier.wait, START_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a broken barrier: a process failed before the start
        _stop(procs)
        raise ClientProcessError(f"the client processes did not start: {_first_error(out) or exc}") from exc
    start = time.perf_counter()
    records, lag = await _collect(procs, out, on_record)
    wall = time.perf_counter() - start
    records.sort(key=lambda r: (r.sent_s, r.request_index))
    return [dataclasses.replace(r, request_index=k) for k, r in enumerate(records)], lag, wall


async def _collect(procs: list[Any], out: Any,
                   on_record: OnRecord | None) -> tuple[list[RequestRecord], list[tuple[float, float]]]:
    records: list[RequestRecord] = []
    lag: list[tuple[float, float]] = []
    num_done = 0
    while num_done < len(procs):
        try:
            kind, value = await asyncio.to_thread(out.get, True, POLL_S)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                _stop(procs)
                raise ClientProcessError(f"client process {dead[0].name} died (exit code {dead[0].exitcode})")
            continue
        if kind == "record":
            records.append(value)
            if on_record is not None:
                on_record(value)
        elif kind == "done":
            lag.extend(value)
            num_done += 1
        else:
            _stop(procs)
            raise ClientProcessError(f"a client process failed: {value}")
    for proc in procs:
        proc.join(5)
    lag.sort()
    return records, lag


def _first_error(out: Any) -> str | None:
    try:
        while True:
            kind, value = out.get_nowait()
            if kind == "error":
                return str(value)
    except queue.Empty:
        return None


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
