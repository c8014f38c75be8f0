"""Join kvpilot's per-request server timings with the client's own into a per-stage split.

The server reports ``{"kvpilot": {"request_id", "prompt_tokens", "cached_tokens", "num_preemptions",
"timings": {queue_ms, tokenize_ms, prefill_ms, ttft_ms, decode_ms, serialize_ms, e2e_ms}}}`` (and, when the
request verified drafts, ``"speculation": {num_drafts, draft_tokens, accepted_tokens}``) on the
final JSON / last SSE chunk, and non-streaming responses carry a ``Server-Timing`` header.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from kvpilot.bench.records import RequestRecord, ServerTimings

STAGES: tuple[str, ...] = ("network", "queue", "tokenize", "prefill", "decode", "serialize", "other")
_TIMING_KEYS = ("queue_ms", "tokenize_ms", "prefill_ms", "ttft_ms", "decode_ms", "serialize_ms",
                "e2e_ms")


def parse_kvpilot_field(payload: Mapping[str, Any]) -> ServerTimings | None:
    """Read the top-level ``"kvpilot"`` field of a response body or SSE chunk; None if absent/bad."""
    field = payload.get("kvpilot")
    if not isinstance(field, Mapping) or not isinstance(field.get("timings"), Mapping):
        return None
    t = field["timings"]
    spec = field.get("speculation") if isinstance(field.get("speculation"), Mapping) else {}
    try:
        values = {k: float(t.get(k, 0.0) or 0.0) for k in _TIMING_KEYS}
        return ServerTimings(
            request_id=str(field.get("request_id", "")),
            num_prompt_tokens=int(field.get("prompt_tokens", 0) or 0),
            num_cached_tokens=int(field.get("cached_tokens", 0) or 0),
            num_preemptions=int(field.get("num_preemptions", 0) or 0),
            **values, num_drafts=int(spec.get("num_drafts", 0) or 0),
            num_draft_tokens=int(spec.get("draft_tokens", 0) or 0),
            num_accepted_tokens=int(spec.get("accepted_tokens", 0) or 0),
            num_tier_cached_tokens=int(field.get("tier_cached_tokens", 0) or 0),
        )
    except (TypeError, ValueError):
        return None


def parse_server_timing_header(header: str | None) -> dict[str, float]:
    """``queue;dur=1.2, prefill;dur=30`` -> ``{"queue": 1.2, "prefill": 30.0}`` (ms)."""
    out: dict[str, float] = {}
    for entry in (header or "").split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if name and key.strip().lower() == "dur":
                try:
                    out[name] = float(value.strip().strip('"'))
                except ValueError:
                    pass
    return out


def timings_from_header(header: str | None, request_id: str = "") -> ServerTimings | None:
    """Build server timings from a ``Server-Timing`` header alone (no e2e there: sum of stages)."""
    durs = parse_server_timing_header(header)
    if not durs:
        return None
    stages = {k: durs.get(k, 0.0) for k in ("queue", "tokenize", "prefill", "decode", "serialize")}
    return ServerTimings(
        request_id=request_id, num_prompt_tokens=0, num_cached_tokens=0, num_preemptions=0,
        queue_ms=stages["queue"], tokenize_ms=stages["tokenize"], prefill_ms=stages["prefill"],
        ttft_ms=stages["queue"] + stages["tokenize"] + stages["prefill"],
        decode_ms=stages["decode"], serialize_ms=stages["serialize"], e2e_ms=sum(stages.values()),
    )


def stage_breakdown(record: RequestRecord) -> dict[str, float] | None:
    """Split the client's E2E into network + queue + tokenize + prefill + decode + serialize + other.

    Invariant: the values sum to ``record.e2e_ms`` exactly. ``network`` is client E2E minus server
    E2E (transport both ways plus HTTP handling outside the server's timer); ``other`` is the
    server time its named stages do not cover. None when the server sent no timings.
    """
    s = record.server
    if s is None or record.e2e_ms is None:
        return None
    named = {"queue": s.queue_ms, "tokenize": s.tokenize_ms, "prefill": s.prefill_ms,
             "decode": s.decode_ms, "serialize": s.serialize_ms}
    return {"network": record.e2e_ms - s.e2e_ms, **named, "other": s.e2e_ms - sum(named.values())}
