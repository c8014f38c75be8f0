"""One client's request loops: the closed loop (N workers, each sending its next request when the last one
finished) and the open loop (requests sent at planned arrival times), each request measured into a
RequestRecord, plus the event-loop lag probe. runner.py drives them in this process; client_processes.py in
several."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Iterator

import aiohttp
import numpy as np

from kvpilot.bench.arrivals import arrival_times
from kvpilot.bench.client import Outcome, Target, build_payload, execute
from kvpilot.bench.load import LoadShape
from kvpilot.bench.prompt_copy import count_copied
from kvpilot.bench.records import RequestRecord, WorkItem
from kvpilot.bench.replicas import replica_id
from kvpilot.bench.tokens import Tokenizer, count_tokens

LOOP_TICK_S = 0.01
OnRecord = Callable[[RequestRecord], None]


def _record(idx: int, item: WorkItem, turn_idx: int, out: Outcome, t0: float, scheduled: float,
            started: float, acquired: float, prompt_text: str, tok: Tokenizer,
            routed_to: str | None = None) -> RequestRecord:
    usage = out.usage or {}
    if isinstance(usage.get("completion_tokens"), int):
        num_out, source = usage["completion_tokens"], "usage"
    else:
        num_out, source = count_tokens(tok, out.text), tok.name
    chunks = out.chunk_times
    ttft = (chunks[0] - out.t_sent) * 1000 if chunks else None
    copy = count_copied(prompt_text, out.text) if out.ok else None
    return RequestRecord(
        request_index=idx, item_id=item.item_id, turn_index=turn_idx, group_id=item.group_id,
        ok=out.ok, status=out.status, error_kind=out.error_kind, error=out.error,
        scheduled_s=scheduled - t0, sent_s=out.t_sent - t0,
        queue_wait_ms=(acquired - started) * 1000, sched_lag_ms=max(0.0, started - scheduled) * 1000,
        ttft_ms=ttft if out.ok else None,
        e2e_ms=((out.t_end or out.t_sent) - out.t_sent) * 1000,
        itl_ms=tuple(float(b - a) * 1000 for a, b in itertools.pairwise(chunks)) if out.ok else (),
        num_prompt_tokens=usage.get("prompt_tokens") or count_tokens(tok, prompt_text),
        num_output_tokens=num_out if out.ok else 0, output_tokens_source=source,
        num_chunks=len(chunks), retry_after_s=out.retry_after_s, server=out.server,
        server_prompt_ms=out.server_prompt_ms,
        output_text=out.text, replica=out.replica or routed_to,
        num_output_words=copy.num_output_words if copy else 0, num_copied_words=copy.num_copied_words if copy else 0,
        num_usage_cached_tokens=usage_cached_tokens(usage),
    )


def usage_cached_tokens(usage: dict) -> int | None:
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``; None when absent."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None


class RequestLoop:
    """State of one run; every request loop is bounded by the request budget or the deadline. With
    ``routes`` (one target per replica URL), requests go to them round-robin in the order they are sent."""

    def __init__(self, session: aiohttp.ClientSession, target: Target, shape: LoadShape, tok: Tokenizer,
                 on_record: OnRecord | None, routes: tuple[Target, ...] = (), t0: float | None = None) -> None:
        """``t0``: the perf_counter origin of the records' times (default now); client processes share the
        parent's (perf_counter is the system-wide monotonic clock on Linux and macOS)."""
        self.session, self.target, self.shape, self.tok, self.on_record = session, target, shape, tok, on_record
        self.routes = itertools.cycle(routes) if routes else None
        self.t0, self.start_unix = time.perf_counter() if t0 is None else t0, time.time()
        self.next_index = 0
        self.records: list[RequestRecord] = []
        cap = shape.max_concurrency if not shape.closed_loop else None
        self.slots = asyncio.Semaphore(cap) if cap else None

    def claim(self, limit: int | None, deadline: float | None) -> int | None:
        """Next request index, or None once the budget or the deadline is reached."""
        if (limit is not None and self.next_index >= limit) or (
                deadline is not None and time.perf_counter() >= deadline):
            return None
        self.next_index += 1
        return self.next_index - 1

    async def run_item(self, item: WorkItem, scheduled: float, limit: int | None,
                       deadline: float | None, measured: bool = True) -> None:
        """Send the item's turns in order, each carrying the history of earlier turns and answers."""
        history: list[dict[str, str]] = list(item.messages or [])
        for turn_idx, turn in enumerate(item.turns):
            idx = self.claim(limit, deadline)
            if idx is None:
                return
            started = time.perf_counter()
            if item.messages is None:
                history.append({"role": "user", "content": turn.text})
            prompt = "\n".join(m["content"] for m in history)
            payload = build_payload(self.target, prompt, history, turn.max_tokens)
            if self.slots is not None:
                await self.slots.acquire()
            acquired = time.perf_counter()
            target = next(self.routes) if self.routes is not None else self.target
            try:
                out = await execute(self.session, target, payload)
            finally:
                if self.slots is not None:
                    self.slots.release()
            routed_to = replica_id(target.base_url) if self.routes is not None else None
            rec = _record(idx, item, turn_idx, out, self.t0, scheduled, started, acquired, prompt, self.tok,
                          routed_to)
            if measured:
                self.records.append(rec)
                if self.on_record:
                    self.on_record(rec)
            if not out.ok:
                return  # a session cannot continue without the answer it builds on
            history.append({"role": "assistant", "content": out.text})
            scheduled = time.perf_counter()

    async def run_measured(self, items: list[WorkItem]) -> float:
        """The shape's measured load (closed or open loop, bounded by its requests and duration) on this event
        loop; returns its wall seconds."""
        t_start = time.perf_counter()
        deadline = t_start + self.shape.duration_s if self.shape.duration_s else None
        if self.shape.closed_loop:
            await self.closed_loop(itertools.cycle(items), self.shape.num_requests, deadline)
        else:
            await self.open_loop(items, self.shape.num_requests, deadline)
        return time.perf_counter() - t_start

    async def closed_loop(self, items: Iterator[WorkItem], limit: int | None, deadline: float | None) -> None:
        async def worker() -> None:
            while self.next_index < (limit if limit is not None else math.inf):
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                await self.run_item(next(items), time.perf_counter(), limit, deadline)

        await asyncio.gather(*(worker() for _ in range(self.shape.concurrency or 1)))

    async def open_loop(self, items: list[WorkItem], limit: int | None, deadline: float | None) -> None:
        shape = self.shape
        traced = all(it.arrival_s is not None for it in items)
        expected = limit if limit is not None else int(shape.request_rate * (shape.duration_s or 0) * 2) + 100
        num_items = len(items) if traced else max(1, min(expected, 1_000_000))
        times = ([it.arrival_s or 0.0 for it in items] if traced else
                 arrival_times(shape.request_rate, num_items, np.random.default_rng(shape.seed),
                               shape.arrival, shape.burstiness))
        cycle = itertools.cycle(items)
        start, tasks, num_planned = time.perf_counter(), [], 0
        for offset in times:
            if (limit is not None and num_planned >= limit) or (
                    deadline is not None and time.perf_counter() >= deadline):
                break
            planned = start + offset
            await asyncio.sleep(max(0.0, planned - time.perf_counter()))
            item = next(cycle)
            num_planned += len(item.turns)
            tasks.append(asyncio.create_task(self.run_item(item, planned, limit, deadline)))
        await asyncio.gather(*tasks)


async def probe_loop_lag(stop: asyncio.Event, t0: float, out: list[tuple[float, float]]) -> None:
    while not stop.is_set():
        before = time.perf_counter()
        await asyncio.sleep(LOOP_TICK_S)
        now = time.perf_counter()
        out.append((now - t0, max(0.0, (now - before - LOOP_TICK_S) * 1000)))
