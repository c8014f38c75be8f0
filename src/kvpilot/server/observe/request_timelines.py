"""``GET /v1/kvpilot/requests/{request_id}``: one recent request's timeline and the requests that overlapped it.

Every response already carries its own stage timings (the ``kvpilot`` field); this keeps them, for the last
``RING_SIZE`` engine requests, in a bounded ring, so ``kvpilot doctor --request ID`` can answer "why was request
X slow?" with the other requests that ran, prefilled or waited while it did (head-of-line blocking behind a long
prompt, preemptions, a prefix-cache miss). Behind the API key like every route but the open ones (ApiKeyGuard),
and left out of the OpenAPI schema (a diagnostic route, not part of the serving API).

A timeline is recorded where the access-log line and the trace are (``Finisher.log`` calls ``state.tracer
.record`` once per finished engine request): :func:`add_request_timeline_routes` wraps the server's tracer in a
:class:`RecordingTracer` that adds each request to the ring and then passes the call on, so no serving code changes.
Times: ``arrival_unix`` is wall-clock seconds (from the engine's monotonic stamp), every stage in ms after it, as
in the ``kvpilot`` field (tokenize + queue + prefill = ttft; ttft + decode + serialize = e2e). Per step: the engine
step the request was queued before (``queued_step``), each chunk of its prompt (and of a recompute after a
preemption) with its step index, tokens and ms after arrival, and its ``MAX_GAPS`` longest pauses between output
tokens; steps are counted by the engine core, so two requests' chunks with one index ran in the same step.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from itertools import accumulate
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kvpilot.engine.timeline import RequestMetrics
from kvpilot.server.observe.timings import RequestTimings
from kvpilot.server.openai.errors import APIError
from kvpilot.server.prepared import Prepared
from kvpilot.server.state import ServerState

PATH = "/v1/kvpilot/requests"
RING_SIZE = 2048
"""Requests kept: minutes of traffic on a busy server, a few hundred KB of memory."""
MAX_GAPS = 3


@dataclass(frozen=True)
class RequestTimeline:
    """One finished engine request: what it asked for, what it got, and where its time went (ms)."""

    request_id: str
    endpoint: str
    status: int
    arrival_unix: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    num_output_tokens: int
    timings: dict[str, float]
    queued_step: int | None = None
    prefill_chunks: tuple[dict[str, float], ...] = ()
    longest_gaps: tuple[dict[str, float], ...] = ()

    @property
    def end_unix(self) -> float:
        return self.arrival_unix + self.timings["e2e_ms"] / 1000.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class TimelineRing:
    """The last ``size`` timelines by request id (oldest dropped first). Thread-safe: records come from the
    event loop, reads from request handlers."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, RequestTimeline] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, timeline: RequestTimeline) -> None:
        with self._lock:
            self._items.pop(timeline.request_id, None)
            self._items[timeline.request_id] = timeline
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, request_id: str) -> RequestTimeline | None:
        with self._lock:
            return self._items.get(request_id)

    def overlapping(self, target: RequestTimeline) -> list[RequestTimeline]:
        """The other requests whose life [arrival, end] overlapped the target's, in arrival order."""
        with self._lock:
            items = list(self._items.values())
        return sorted((t for t in items if t.request_id != target.request_id
                       and t.arrival_unix < target.end_unix and t.end_unix > target.arrival_unix),
                      key=lambda t: t.arrival_unix)


def timeline_of(prepared: Prepared, status: int, timings: RequestTimings,
                metrics: RequestMetrics | None) -> RequestTimeline:
    """The ring's record of one finished engine request (its arrival moved from the monotonic clock to wall time)."""
    arrival = time.time() - (time.monotonic() - prepared.message.arrival_time)
    return RequestTimeline(
        request_id=prepared.shape.request_id, endpoint=prepared.endpoint, status=status, arrival_unix=arrival,
        num_prompt_tokens=len(prepared.message.prompt_token_ids),
        num_cached_tokens=metrics.num_cached_tokens if metrics else 0,
        num_preemptions=metrics.num_preemptions if metrics else 0,
        num_output_tokens=metrics.num_generated_tokens if metrics else 0, timings=asdict(timings),
        queued_step=metrics.queued_step if metrics else None,
        prefill_chunks=tuple({"step": c.step_index, "num_tokens": c.num_tokens, "start_ms": c.start * 1000.0,
                              "end_ms": c.end * 1000.0} for c in metrics.prefill_chunks) if metrics else (),
        longest_gaps=longest_gaps(metrics) if metrics else ())


def longest_gaps(metrics: RequestMetrics, num_gaps: int = MAX_GAPS) -> tuple[dict[str, float], ...]:
    """The request's ``num_gaps`` longest pauses between output tokens, longest first: how long (``gap_ms``) and
    when the token that ended it came (``end_ms`` after arrival)."""
    if metrics.ttft is None or not metrics.inter_token_latencies:
        return ()
    gaps = metrics.inter_token_latencies
    ends = accumulate(gaps, initial=metrics.ttft)
    next(ends)  # the first token's time: the first gap ends one token later
    top = heapq.nlargest(num_gaps, zip(gaps, ends))
    return tuple({"gap_ms": gap * 1000.0, "end_ms": end * 1000.0} for gap, end in top)


class RecordingTracer:
    """The server's tracer with each finished request also added to the ring (everything else passes through)."""

    def __init__(self, inner: Any, ring: TimelineRing) -> None:
        self._inner, self.ring = inner, ring

    def record(self, prepared: Prepared, status: int, timings: RequestTimings,
               metrics: RequestMetrics | None) -> None:
        self.ring.add(timeline_of(prepared, status, timings, metrics))
        self._inner.record(prepared, status, timings, metrics)

    def __getattr__(self, name: str) -> Any:  # enabled, force_flush, shutdown
        return getattr(self._inner, name)


def add_request_timeline_routes(app: FastAPI, state: ServerState, size: int = RING_SIZE) -> TimelineRing:
    """Records every finished request in a ring of ``size`` and serves ``GET /v1/kvpilot/requests/{id}``:
    ``{"request": timeline, "overlapping": [timelines]}``, 404 when the id is not (or no longer) in the ring."""
    ring = TimelineRing(size)
    state.tracer = RecordingTracer(state.tracer, ring)  # type: ignore[assignment]

    @app.get(PATH + "/{request_id}", include_in_schema=False)
    async def request_timeline(request_id: str) -> JSONResponse:
        target = ring.get(request_id)
        if target is None:
            return APIError(404, f"request {request_id!r} is not among the last {ring.size} finished requests",
                            code="request_not_found").response()
        return JSONResponse({"request": target.to_json(),
                             "overlapping": [t.to_json() for t in ring.overlapping(target)]})

    return ring
