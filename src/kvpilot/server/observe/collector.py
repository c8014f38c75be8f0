"""A request's sub-requests as their outputs arrive: prompt counting, final timings, the access-log line and
trace per engine request, and the response's usage and `kvpilot` field (one collector per HTTP request)."""

from __future__ import annotations

import logging
from typing import Any

from kvpilot.engine.timeline import RequestMetrics
from kvpilot.outputs import RequestOutput
from kvpilot.server.fanout import sub_request_summary, usage_totals
from kvpilot.server.prepared import Prepared
from kvpilot.server.openai.responses import usage_of
from kvpilot.server.state import ServerState
from kvpilot.server.observe.timings import RequestTimings, access_log_line, kvpilot_field

access_logger = logging.getLogger("kvpilot.access")


class Finisher:
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

    def timings(self, final: RequestOutput | None,
                observe: bool = True) -> tuple[RequestTimings, RequestMetrics | None]:
        """`observe`: count the serialization time (once per HTTP request: a fan-out's last sub-request)."""
        metrics = final.metrics if final is not None and isinstance(final.metrics, RequestMetrics) else None
        timings = RequestTimings.build(arrival=self.prepared.message.arrival_time,
                                       tokenize_s=self.prepared.tokenize_s, metrics=metrics)
        if observe and metrics is not None and metrics.ttft is not None:
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
        self.state.tracer.record(p, status, timings, metrics)  # spans from these timings (tracing.py)


class Collector:
    """A request's sub-requests as they finish: one _Finisher each (prompt counting, timings, access-log line
    and trace per engine request), their final outputs, and the response's usage and `kvpilot` field.
    Invariant: `remaining` == the number of sub-requests without a final output."""

    def __init__(self, state: ServerState, prepared: Prepared) -> None:
        self.prepared = prepared
        size = prepared.fanout.size
        self.finishers = [Finisher(state, prepared.for_sub(k)) for k in range(size)]
        self.finals: list[RequestOutput | None] = [None] * size
        self._ends: list[tuple[RequestTimings, RequestMetrics | None] | None] = [None] * size
        self.remaining = size
        self.last = 0

    def saw(self, k: int, item: RequestOutput) -> None:
        self.finishers[k].saw(item)
        if item.finished:
            self.finals[k], self.last = item, k
            self.remaining -= 1
            if self.remaining:  # its own timings end now; the last one's when the response is built
                self._ends[k] = self.finishers[k].timings(item, observe=False)

    def finish(self) -> tuple[RequestTimings, dict[str, Any], dict[str, Any]]:
        """After every sub-request finished: the response's timings (the last sub-request's), usage and
        `kvpilot` field."""
        finals = [f for f in self.finals if f is not None]
        last = finals[self.last]
        self._ends[self.last] = timings, metrics = self.finishers[self.last].timings(last)
        field = self.finishers[self.last].field(last, timings, metrics)
        totals = usage_totals(self.prepared.fanout, finals)
        if self.prepared.fanout.size > 1:
            field.update(request_id=self.prepared.shape.request_id, prompt_tokens=totals.prompt_tokens,
                         cached_tokens=totals.cached_tokens, sub_requests=sub_request_summary(finals),
                         num_preemptions=sum(getattr(o.metrics, "num_preemptions", 0) for o in finals))
        return timings, usage_of(totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens), field

    def log(self, status: int) -> None:
        for finisher, end in zip(self.finishers, self._ends):
            if end is not None:
                finisher.log(status, *end)
