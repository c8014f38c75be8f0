"""One request's engine steps, joined with other requests' by step index: what it waited behind, and what
filled the steps of its longest pauses between tokens.

The server's timeline of a request (``/v1/kvpilot/requests/{id}``, server/observe/request_timelines.py) names the
step the request was queued before, each chunk of its prompt with the step that computed it, and its longest
gaps between output tokens. Steps are counted by the engine core, so another request's chunk with a step index
in the request's wait ran in a step the request waited through (or shared, for the step of its own first
token): exact membership, not inferred from overlapping windows. A gap between two of its tokens is filled by
the chunks that ended inside it (the step that ended it included).

Pure: reads the route's JSON, returns dataclasses; request_explain.py words them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

EPSILON_S = 0.0005
"""Two requests' stamps of one step can differ by the wall-clock conversion (microseconds) and the route's
rounding to a microsecond: within this, they are one instant."""
STALL_FACTOR = 3.0
"""A gap between tokens this many times the request's mean is a stall worth naming."""


@dataclass(frozen=True)
class Chunk:
    """One step's chunk of a request's prompt (or recompute): times in wall seconds."""

    request_id: str
    step: int
    num_tokens: int
    start: float
    end: float


def chunks_of(t: dict[str, Any]) -> list[Chunk]:
    """The prefill chunks of one route timeline, in step order ([] from a server that records none)."""
    arrival, rid = float(t["arrival_unix"]), str(t["request_id"])
    return [Chunk(rid, int(c["step"]), int(c["num_tokens"]), arrival + float(c["start_ms"]) / 1000.0,
                  arrival + float(c["end_ms"]) / 1000.0) for c in t.get("prefill_chunks") or ()]


@dataclass(frozen=True)
class Wait:
    """The steps from the request's queueing to its first token (both ends included): ``own`` are its prompt's
    chunks in them, ``recomputed`` its chunks after the first token (recomputes after preemptions)."""

    queued_step: int
    first_token_step: int
    own: tuple[Chunk, ...]
    recomputed: tuple[Chunk, ...]

    @property
    def num_steps(self) -> int:
        return self.first_token_step - self.queued_step + 1


def wait_of(t: dict[str, Any]) -> Wait | None:
    """The request's wait in steps; None when the server recorded no steps or the request got no token."""
    chunks, queued = chunks_of(t), t.get("queued_step")
    first_token = float(t["arrival_unix"]) + float(t["timings"]["ttft_ms"]) / 1000.0
    own = [c for c in chunks if c.end <= first_token + EPSILON_S]
    if queued is None or not own or not t["timings"]["ttft_ms"]:
        return None
    return Wait(int(queued), own[-1].step, tuple(own), tuple(c for c in chunks if c.end > first_token + EPSILON_S))


@dataclass(frozen=True)
class StepShare:
    """Another request's chunks in some of the target's steps: how many chunks, tokens and seconds of steps."""

    request_id: str
    num_chunks: int
    num_tokens: int
    seconds: float


def shares_in_steps(first_step: int, last_step: int, others: Iterable[Chunk]) -> list[StepShare]:
    """Per other request, its chunks computed in steps first_step..last_step; most tokens first."""
    return _shares(c for c in others if first_step <= c.step <= last_step)


def _shares(chunks: Iterable[Chunk]) -> list[StepShare]:
    by_id: dict[str, list[Chunk]] = {}
    for c in chunks:
        by_id.setdefault(c.request_id, []).append(c)
    shares = [StepShare(rid, len(cs), sum(c.num_tokens for c in cs), sum(c.end - c.start for c in cs))
              for rid, cs in by_id.items()]
    return sorted(shares, key=lambda s: (-s.num_tokens, s.request_id))


@dataclass(frozen=True)
class Stall:
    """One long gap between the target's tokens and the requests whose chunks filled it (``own``: the target's
    own recompute was among them)."""

    gap_ms: float
    end_ms: float
    shares: tuple[StepShare, ...]


def stalls_of(t: dict[str, Any], others: list[Chunk], factor: float = STALL_FACTOR) -> list[Stall]:
    """The target's recorded longest gaps of at least ``factor`` times its mean gap, each with the chunks (its
    own recomputes included) that ended inside it."""
    ms, arrival = t["timings"], float(t["arrival_unix"])
    num_gaps = int(t.get("num_output_tokens") or 0) - 1
    if num_gaps < 1 or not ms.get("decode_ms"):
        return []
    mean_ms = float(ms["decode_ms"]) / num_gaps
    candidates = [*others, *chunks_of(t)]
    found = []
    for g in t.get("longest_gaps") or ():
        gap_ms, end_ms = float(g["gap_ms"]), float(g["end_ms"])
        if gap_ms < factor * mean_ms:
            continue
        lo, hi = arrival + (end_ms - gap_ms) / 1000.0, arrival + end_ms / 1000.0
        inside = [c for c in candidates if lo + EPSILON_S < c.end <= hi + EPSILON_S]
        found.append(Stall(gap_ms, end_ms, tuple(_shares(inside))))
    return found
