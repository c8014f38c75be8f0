"""Where one request's time went: the stage split returned with each response and logged per request.

Stages (ms) tile the request's life at the HTTP layer:
    tokenize + queue + prefill = ttft;  ttft + decode + serialize = e2e
tokenize: HTTP arrival -> prompt token ids ready; queue: -> first scheduled (message hand-off + waiting in
the scheduler); prefill: -> first token; decode: first -> last token; serialize: last token -> the final
body/chunk handed to the client (detokenize + JSON + SSE). A stage never reached counts 0.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvpilot.engine.timeline import RequestMetrics

STAGES: tuple[str, ...] = ("queue", "tokenize", "prefill", "decode", "serialize")


@dataclass(frozen=True)
class RequestTimings:
    """Per-request stage split in milliseconds; invariants as in the module docstring (up to rounding)."""

    queue_ms: float
    tokenize_ms: float
    prefill_ms: float
    ttft_ms: float
    decode_ms: float
    serialize_ms: float
    e2e_ms: float

    @classmethod
    def build(cls, *, arrival: float, tokenize_s: float, metrics: RequestMetrics | None,
              end: float | None = None) -> RequestTimings:
        """`arrival`/`end` on time.monotonic (the engine's clock); `metrics` from the final RequestOutput."""
        end = time.monotonic() if end is None else end
        e2e = end - arrival
        prefill = (metrics.prefill_time or 0.0) if metrics else 0.0
        ttft = metrics.ttft if metrics and metrics.ttft is not None else None
        decode = (metrics.decode_time or 0.0) if metrics else 0.0
        if ttft is None:  # no token: everything after tokenizing was waiting
            return cls.from_seconds(queue=max(0.0, e2e - tokenize_s), tokenize=tokenize_s, prefill=0.0,
                                    ttft=0.0, decode=0.0, serialize=0.0, e2e=e2e)
        queue = max(0.0, ttft - tokenize_s - prefill)
        serialize = max(0.0, e2e - ttft - decode)
        return cls.from_seconds(queue=queue, tokenize=tokenize_s, prefill=prefill, ttft=ttft, decode=decode,
                                serialize=serialize, e2e=e2e)

    @classmethod
    def from_seconds(cls, **seconds: float) -> RequestTimings:
        return cls(**{f"{k}_ms": round(v * 1000.0, 3) for k, v in seconds.items()})

    def server_timing_header(self) -> str:
        """`Server-Timing: queue;dur=1.2, tokenize;dur=0.3, ...` (W3C syntax, ms)."""
        return ", ".join(f"{s};dur={getattr(self, s + '_ms'):.3f}" for s in STAGES)


def kvpilot_field(request_id: str, metrics: RequestMetrics | None, num_prompt_tokens: int,
                  timings: RequestTimings) -> dict[str, Any]:
    """The top-level `"kvpilot"` field of the final body / last SSE chunk (the bench parses exactly this)."""
    return {"request_id": request_id, "prompt_tokens": num_prompt_tokens,
            "cached_tokens": metrics.num_cached_tokens if metrics else 0, **tier_field(metrics),
            "num_preemptions": metrics.num_preemptions if metrics else 0,
            "timings": asdict(timings), **speculation_field(metrics)}


def tier_field(metrics: RequestMetrics | None) -> dict[str, Any]:
    """{"tier_cached_tokens": n}: of cached_tokens, those copied back from a KV offload tier (--kv-offloading-
    size) rather than found in the KV cache; {"kv_transfer_tokens": n, "kv_transfer_ms": t}: of cached_tokens,
    those pulled from a prefill worker (disaggregation) and the pull's time; {} when neither (responses
    without offload or disaggregation keep their shape)."""
    field: dict[str, Any] = {}
    if metrics is not None and metrics.num_tier_cached_tokens:
        field["tier_cached_tokens"] = metrics.num_tier_cached_tokens
    if metrics is not None and metrics.num_kv_transfer_tokens:  # disaggregation: pulled from a prefill worker
        field["kv_transfer_tokens"] = metrics.num_kv_transfer_tokens
        field["kv_transfer_ms"] = round(metrics.kv_transfer_time * 1000.0, 3)
    return field


def speculation_field(metrics: RequestMetrics | None) -> dict[str, Any]:
    """{"speculation": {verifications, drafted and accepted tokens, acceptance rate, ms spent drafting}} for a
    request that verified drafts, else {} (responses without speculation keep their shape)."""
    if metrics is None or not metrics.num_drafts:
        return {}
    return {"speculation": {"num_drafts": metrics.num_drafts, "draft_tokens": metrics.num_draft_tokens,
                            "accepted_tokens": metrics.num_accepted_tokens,
                            "acceptance_rate": round(metrics.draft_acceptance_rate or 0.0, 4),
                            "draft_ms": round(metrics.draft_time * 1000.0, 3)}}


def access_log_line(*, request_id: str, endpoint: str, status: int, stream: bool, metrics: RequestMetrics | None,
                    num_prompt_tokens: int, timings: RequestTimings, prompt: str | None = None) -> str:
    """One JSON object per request; the prompt text only when the operator asked (--log-prompts)."""
    record: dict[str, Any] = {
        "event": "request", "request_id": request_id, "endpoint": endpoint, "status": status, "stream": stream,
        "finish_reason": metrics.finish_reason if metrics else None, "prompt_tokens": num_prompt_tokens,
        "generation_tokens": metrics.num_generated_tokens if metrics else 0,
        "cached_tokens": metrics.num_cached_tokens if metrics else 0, **tier_field(metrics),
        "num_preemptions": metrics.num_preemptions if metrics else 0, **asdict(timings),
        **speculation_field(metrics)}
    if prompt is not None:
        record["prompt"] = prompt
    return json.dumps(record)
