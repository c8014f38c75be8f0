"""Drive one run: warmup, then closed- or open-loop load, with metrics scraping and lag tracking."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import time
from dataclasses import dataclass, field

import httpx

from kvpilot.bench.client import Target, open_session
from kvpilot.bench.client_processes import ProcessPlan, run_in_processes
from kvpilot.bench.clientlag import thread_run_delay_ms
from kvpilot.bench.load import LoadShape
from kvpilot.bench.records import RequestRecord, WorkItem
from kvpilot.bench.replicas import ReplicaPlan, ReplicaSample, ReplicaScraper, replica_id
from kvpilot.bench.request_loop import OnRecord, RequestLoop, probe_loop_lag
from kvpilot.bench.scrape import MetricsSample, Scraper
from kvpilot.bench.tokens import Tokenizer


@dataclass(frozen=True)
class RunOutput:
    """Measured records (warmup excluded) plus the client's own health and server metrics.

    ``loop_lag_ms`` samples how late a 10 ms event-loop tick fired, as (t_s, lag_ms): high values
    mean the client itself was the bottleneck. ``replica_samples`` are the per-replica scrapes when the run
    had a :class:`ReplicaPlan` (``replica_plan``), with ``replica_error`` saying why there are none.
    """

    shape: LoadShape
    records: list[RequestRecord]
    wall_s: float
    start_unix: float
    loop_lag_ms: list[tuple[float, float]]
    metrics: list[MetricsSample] = field(default_factory=list)
    metrics_error: str | None = None
    replica_plan: ReplicaPlan | None = None
    replica_samples: list[ReplicaSample] = field(default_factory=list)
    replica_error: str | None = None
    num_client_processes: int = 1  # the processes that sent the measured load (--client-processes)
    loop_run_delay_ms: float | None = None  # the event loop's thread waiting for a CPU over the run (clientlag.py)


async def run_load(target: Target, items: list[WorkItem], shape: LoadShape, tok: Tokenizer, *,
                   metrics_url: str | None = None, scrape_interval_s: float = 1.0,
                   on_record: OnRecord | None = None, replicas: ReplicaPlan | None = None,
                   scrape_replicas: bool = True, processes: ProcessPlan | None = None) -> RunOutput:
    """Run warmup then the measured load; never raises for server faults (they become records).

    ``processes`` with more than one process: the measured load runs in that many client processes
    (client_processes.py), whose event loops' lag is the one reported; warmup and scrapes stay here.

    ``replicas``: scrape each replica too (unless ``scrape_replicas`` is False); when the plan routes, send
    the requests round-robin over its URLs instead of to ``target.base_url``, and (without ``metrics_url``)
    take the deployment-wide samples as the sum of the replicas'.

    Objects alive before the run (a tokenizer, torch) are frozen out of the garbage collector for
    its duration: full collections over a large heap pause the event loop and would inflate TTFT.
    """
    gc.collect()
    gc.freeze()
    try:
        return await _run_load(target, items, shape, tok, metrics_url, scrape_interval_s, on_record, replicas,
                               scrape_replicas, processes if processes and processes.num_processes > 1 else None)
    finally:
        gc.unfreeze()


async def _run_load(target: Target, items: list[WorkItem], shape: LoadShape, tok: Tokenizer,
                    metrics_url: str | None, scrape_interval_s: float, on_record: OnRecord | None,
                    replicas: ReplicaPlan | None, scrape_replicas: bool, processes: ProcessPlan | None) -> RunOutput:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    routes = tuple(dataclasses.replace(target, base_url=replica_id(u)) for u in replicas.urls) \
        if replicas is not None and replicas.route else ()
    # httpx for the /metrics scrapes, with the target's headers (a server with --api-key guards them); the
    # requests go through aiohttp (client.py).
    async with httpx.AsyncClient(limits=limits, timeout=target.timeout_s, headers=target.headers()) as http, \
            open_session(target) as session:
        if shape.num_warmup:
            warm = RequestLoop(session, target, shape, tok, None, routes)
            for item in itertools.islice(itertools.cycle(items), shape.num_warmup):
                await warm.run_item(item, time.perf_counter(), shape.num_warmup, None, measured=False)
        run = RequestLoop(session, target, shape, tok, on_record, routes)
        stop, lag = asyncio.Event(), list[tuple[float, float]]()
        scraper = Scraper(http, metrics_url, run.t0, scrape_interval_s) if metrics_url else None
        per_replica = ReplicaScraper(http, replicas, run.t0, scrape_interval_s) \
            if replicas is not None and scrape_replicas else None
        if scraper:
            await scraper.scrape("before")
        if per_replica:
            await per_replica.scrape("before")
        background = [] if processes else [asyncio.create_task(probe_loop_lag(stop, run.t0, lag))]
        if scraper:
            background.append(asyncio.create_task(scraper.poll(stop)))
        if per_replica:
            background.append(asyncio.create_task(per_replica.poll(stop)))
        if processes:
            records, process_lag, wall = await run_in_processes(processes, target, items, shape, routes, run.t0,
                                                                on_record)
            lag.extend(process_lag)
            waited = None
        else:
            before = thread_run_delay_ms()
            records, wall = await _run_here(run, items)
            after = thread_run_delay_ms()
            waited = after - before if before is not None and after is not None else None
        stop.set()
        await asyncio.gather(*background)
        if scraper:
            await scraper.scrape("after")
        if per_replica:
            await per_replica.scrape("after")
    metrics, metrics_error = (scraper.samples, scraper.last_error if not scraper.samples else None) \
        if scraper else ([], None)
    if scraper is None and per_replica is not None and routes:  # no server sees the whole deployment
        metrics = per_replica.aggregate_samples()
        metrics_error = None if metrics else per_replica.last_error or "no round where every replica answered"
    return RunOutput(shape, records, wall, run.start_unix, lag, metrics, metrics_error, replicas,
                     per_replica.samples if per_replica else [],
                     per_replica.last_error if per_replica and not per_replica.samples else None,
                     processes.num_processes if processes else 1, waited)


async def _run_here(run: RequestLoop, items: list[WorkItem]) -> tuple[list[RequestRecord], float]:
    """The measured load on this process's event loop: (records in request order, wall seconds)."""
    wall = await run.run_measured(items)
    return sorted(run.records, key=lambda r: r.request_index), wall
