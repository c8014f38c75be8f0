"""``kvpilot doctor --url URL --request ID``: why was one request slow, and which other requests made it so.

kvpilot keeps the timelines of its last finished requests (``GET /v1/kvpilot/requests/{id}``: the request and the
ones whose life overlapped it; each with its stage timings, prompt and cached tokens, preemptions). From them:

* **where its time went**: the stage that took the most of its E2E (tokenize, queue, prefill, decode);
* **who it waited behind**: the engine steps from its queueing to its first token, its prompt's chunks in them,
  and the other requests whose prompt chunks were computed in those steps (request_steps.py: exact step
  membership), most tokens first, by id with their prompt and tokens; a long prompt prefilled in the same
  steps is head-of-line blocking. From a server that records no steps: the requests whose prefill window
  overlapped its [arrival, first token], longest overlap first;
* **its stalls**: its longest pauses between tokens (several times its mean) and the prompts computed in them;
* **what else happened to it**: preemptions (its KV was freed and its tokens recomputed: how many), and how much
  of its prompt the prefix cache served (0 of many tokens on a repeated prompt is a miss).

Pure except :func:`fetch_timelines` and :func:`explain_slowest`; :func:`explain` returns an :class:`Explanation`
the CLI prints or dumps. :func:`explain_slowest` does the same for the slowest requests of a ``kvpilot bench``
result (its HTML report's doctor section), adding what the client measured beyond the server: how late the load
generator sent the request, and its end-to-end time outside the server (network, the client's own loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from kvpilot.doctor.errors import DoctorInputError
from kvpilot.doctor.request_steps import (Chunk, Stall, StepShare, Wait, chunks_of, shares_in_steps, stalls_of,
                                          wait_of)

PATH = "/v1/kvpilot/requests/"
STAGES = ("tokenize", "queue", "prefill", "decode", "serialize")
MAX_BLOCKERS = 3
MAX_SLOWEST = 3
MIN_BLOCKER_TOKENS = 16
MIN_CLIENT_MS = 1.0
"""A client-side delay below this is measurement noise, not worth a line."""


class ServerUnreachable(DoctorInputError):
    """No answer from the server at all (not an answer without the request's timeline)."""


@dataclass(frozen=True)
class Window:
    """One request's stage windows in wall seconds, from its timeline (module docstring of the server route)."""

    request_id: str
    prompt_tokens: int
    arrival: float
    scheduled: float
    first_token: float
    end: float
    prefill_ms: float

    @staticmethod
    def of(t: dict[str, Any]) -> Window:
        ms, a = t["timings"], float(t["arrival_unix"])
        scheduled = a + (ms["tokenize_ms"] + ms["queue_ms"]) / 1000.0
        return Window(str(t["request_id"]), int(t["num_prompt_tokens"]), a, scheduled,
                      a + ms["ttft_ms"] / 1000.0, a + ms["e2e_ms"] / 1000.0, float(ms["prefill_ms"]))


@dataclass(frozen=True)
class Blocker:
    """Another request whose prefill ran while the target waited for its first token: ``overlap_ms`` of it in
    the target's wait; with steps recorded, ``num_tokens`` of its prompt in ``num_chunks`` chunks of those steps."""

    request_id: str
    prompt_tokens: int
    prefill_ms: float
    overlap_ms: float
    num_tokens: int | None = None
    num_chunks: int | None = None


@dataclass(frozen=True)
class Explanation:
    """The answer for one request. Invariant: ``stage_ms`` sums to about ``e2e_ms``; ``blockers`` are sorted
    by overlap, longest first, at most ``MAX_BLOCKERS``."""

    request_id: str
    e2e_ms: float
    ttft_ms: float
    stage_ms: dict[str, float]
    slowest_stage: str
    prompt_tokens: int
    cached_tokens: int
    preemptions: int
    blockers: tuple[Blocker, ...]
    ran_alongside: int
    steps_to_first_token: int | None = None
    chunk_tokens: tuple[int, ...] = ()
    recomputed_tokens: int = 0
    stalls: tuple[Stall, ...] = ()
    lines: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "e2e_ms": self.e2e_ms, "ttft_ms": self.ttft_ms,
                "stage_ms": self.stage_ms, "slowest_stage": self.slowest_stage, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "preemptions": self.preemptions,
                "blockers": [b.__dict__ for b in self.blockers], "ran_alongside": self.ran_alongside,
                "steps_to_first_token": self.steps_to_first_token, "chunk_tokens": list(self.chunk_tokens),
                "recomputed_tokens": self.recomputed_tokens,
                "stalls": [{"gap_ms": s.gap_ms, "end_ms": s.end_ms, "by": [x.__dict__ for x in s.shares]}
                           for s in self.stalls],
                "explanation": list(self.lines)}


def fetch_timelines(base_url: str, request_id: str, headers: dict[str, str],
                    timeout_s: float = 10.0) -> dict[str, Any]:
    """The server's answer for ``request_id``; DoctorInputError (exit 2) when it has none to give."""
    url = base_url.rstrip("/").removesuffix("/v1") + PATH + request_id
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ServerUnreachable(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
    if resp.status_code in (401, 403):
        raise DoctorInputError(f"{url} refused the request (HTTP {resp.status_code}): pass the server's key with "
                               "--api-key")
    if resp.status_code == 404:
        raise DoctorInputError(f"{url}: the server has no timeline for {request_id!r} (it keeps its last finished "
                               "requests; a server other than kvpilot has none: use the request id of the "
                               "response's `kvpilot` field)")
    try:
        resp.raise_for_status()
        doc = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise DoctorInputError(f"{url}: no request timeline ({type(exc).__name__}: {exc})") from exc
    return doc


def _blockers(target: Window, others: list[Window]) -> list[Blocker]:
    """Others whose prefill window [scheduled, first token] overlapped the target's [arrival, first token]."""
    found = []
    for o in others:
        overlap = min(target.first_token, o.first_token) - max(target.arrival, o.scheduled)
        if overlap > 0:
            found.append(Blocker(o.request_id, o.prompt_tokens, o.prefill_ms, overlap * 1000.0))
    return sorted(found, key=lambda b: -b.overlap_ms)[:MAX_BLOCKERS]


def _step_blockers(wait: Wait, others: list[Window], other_chunks: list[Chunk]) -> list[Blocker]:
    """Others whose prompt chunks were computed in the steps of the target's wait, most tokens first; only
    those that computed at least half as many tokens there as the target's own prompt (and MIN_BLOCKER_TOKENS):
    a short prompt admitted beside a long one's last chunk shares its step but did not hold it up."""
    by_id = {o.request_id: o for o in others}
    floor = max(MIN_BLOCKER_TOKENS, sum(c.num_tokens for c in wait.own) / 2)
    shares: list[StepShare] = shares_in_steps(wait.queued_step, wait.first_token_step, other_chunks)
    return [Blocker(s.request_id, by_id[s.request_id].prompt_tokens, by_id[s.request_id].prefill_ms,
                    s.seconds * 1000.0, s.num_tokens, s.num_chunks)
            for s in shares if s.num_tokens >= floor][:MAX_BLOCKERS]


def explain(doc: dict[str, Any]) -> Explanation:
    """The explanation of ``doc["request"]`` against ``doc["overlapping"]`` (the server route's answer)."""
    t = doc["request"]
    ms = t["timings"]
    target = Window.of(t)
    docs = list(doc.get("overlapping") or [])
    others = [Window.of(o) for o in docs]
    stage_ms = {s: float(ms[f"{s}_ms"]) for s in STAGES}
    slowest = max(STAGES, key=lambda s: stage_ms[s])
    ran = sum(1 for o in others if o.scheduled < target.scheduled and o.end > target.arrival)  # ran while it queued
    wait = wait_of(t)
    other_chunks = [c for d in docs for c in chunks_of(d)]
    blockers = _step_blockers(wait, others, other_chunks) if wait else _blockers(target, others)
    out = Explanation(str(t["request_id"]), float(ms["e2e_ms"]), float(ms["ttft_ms"]), stage_ms, slowest,
                      int(t["num_prompt_tokens"]), int(t["num_cached_tokens"]), int(t["num_preemptions"]),
                      tuple(blockers), ran, steps_to_first_token=wait.num_steps if wait else None,
                      chunk_tokens=tuple(c.num_tokens for c in wait.own) if wait else (),
                      recomputed_tokens=sum(c.num_tokens for c in wait.recomputed) if wait else 0,
                      stalls=tuple(stalls_of(t, other_chunks)))
    return Explanation(**{**out.__dict__, "lines": tuple(_lines(out))})


def _lines(e: Explanation) -> list[str]:
    share = e.stage_ms[e.slowest_stage] / e.e2e_ms if e.e2e_ms > 0 else 0.0
    lines = [f"request {e.request_id}: {e.e2e_ms:,.0f} ms end to end, first token after {e.ttft_ms:,.0f} ms; "
             f"most of it in {e.slowest_stage} ({e.stage_ms[e.slowest_stage]:,.0f} ms, {share:.0%})"]
    if e.stage_ms["queue"] > 0 and e.ran_alongside:
        lines.append(f"it waited {e.stage_ms['queue']:,.0f} ms to be scheduled while {e.ran_alongside} other "
                     "request(s) were running")
    if e.steps_to_first_token is not None:
        done = (f"in one step ({e.chunk_tokens[0]:,} tokens)" if len(e.chunk_tokens) == 1 else
                f"in {len(e.chunk_tokens)} chunks of " + " + ".join(f"{n:,}" for n in e.chunk_tokens) + " tokens")
        lines.append(f"its first token came in the {_ordinal(e.steps_to_first_token)} engine step after it was "
                     f"queued; its prompt was computed {done}")
    for b in e.blockers:
        lines.append(_blocker_line(b))
    for stall in e.stalls:
        lines.append(_stall_line(e.request_id, stall))
    if e.preemptions:
        redone = f" ({e.recomputed_tokens:,} tokens recomputed)" if e.recomputed_tokens else ""
        lines.append(f"preempted {e.preemptions} time(s): its KV blocks were freed and its prefill recomputed{redone} "
                     "(the KV pool was full: see kv-cache-pressure)")
    if e.prompt_tokens:
        lines.append(f"prefix cache served {e.cached_tokens:,} of its {e.prompt_tokens:,} prompt tokens")
    return lines


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n:,}{suffix}"


def _blocker_line(b: Blocker) -> str:
    if b.num_tokens is None:  # a server that records no steps: inferred from overlapping windows
        return (f"waited behind request {b.request_id}: its {b.prompt_tokens:,}-token prompt was prefilled "
                f"({b.prefill_ms:,.0f} ms) during {b.overlap_ms:,.0f} ms of this request's wait for its first token")
    return (f"waited behind request {b.request_id}: {b.num_chunks} chunk(s) of its {b.prompt_tokens:,}-token prompt "
            f"({b.num_tokens:,} tokens, {b.overlap_ms:,.0f} ms of steps) ran in the steps from this request's "
            "queueing to its first token")


def _stall_line(request_id: str, stall: Stall) -> str:
    head = f"a {stall.gap_ms:,.0f} ms pause between its tokens ({stall.end_ms / 1000.0:,.2f} s after arrival)"
    if not stall.shares:
        return f"{head}: no prompt was computed in it (a slow step, or the host: see cpu-starvation)"
    causes = ", ".join("its own recompute" if s.request_id == request_id else
                       f"request {s.request_id}'s prompt ({s.num_tokens:,} tokens)" for s in stall.shares)
    return f"{head} came while the engine computed {causes}"


# ---- the slowest requests of a bench result -----------------------------------------------------------------

def slowest_records(result: dict[str, Any], max_requests: int = MAX_SLOWEST) -> list[dict[str, Any]]:
    """The bench result's successful requests that carry kvpilot's timings (a request id), slowest end to end
    at the client first; at most ``max_requests``."""
    records = [r for run in result.get("runs") or [] for r in run.get("requests") or []
               if r.get("ok") and r.get("e2e_ms") is not None and (r.get("server") or {}).get("request_id")]
    return sorted(records, key=lambda r: -float(r["e2e_ms"]))[:max_requests]


def client_lines(record: dict[str, Any]) -> list[str]:
    """What the client measured beyond the server, for one bench record."""
    lines = []
    late = float(record.get("sched_lag_ms") or 0.0)
    if late >= MIN_CLIENT_MS:
        lines.append(f"the load generator sent it {late:,.0f} ms after it was due (a busy client)")
    outside = float(record["e2e_ms"]) - float(record["server"]["e2e_ms"])
    if outside >= MIN_CLIENT_MS:
        lines.append(f"{outside:,.0f} ms of the {float(record['e2e_ms']):,.0f} ms the client measured were outside "
                     "the server (network, the client's own event loop)")
    return lines


def explain_slowest(result: dict[str, Any], headers: dict[str, str],
                    max_requests: int = MAX_SLOWEST) -> tuple[list[Explanation], list[str]]:
    """The slowest requests of a bench result explained from the server's ring of timelines (the result's base
    URL), each with :func:`client_lines` added; and a note for each request the server could not explain (a
    server other than kvpilot has no ring; kvpilot keeps its last finished requests only)."""
    base_url = str(((result.get("config") or {}).get("target") or {}).get("base_url") or "")
    explained, notes = [], []
    for record in slowest_records(result, max_requests) if base_url else []:
        request_id = str(record["server"]["request_id"])
        try:
            e = explain(fetch_timelines(base_url, request_id, headers))
        except ServerUnreachable as exc:  # gone since the run: asking for the others would say the same
            notes.append(f"the server did not answer ({exc}): run `kvpilot doctor --url URL --request ID` while "
                         "it is up")
            break
        except DoctorInputError as exc:
            notes.append(f"request {request_id}: {exc}")
            continue
        except (KeyError, TypeError, ValueError) as exc:  # an answer of another shape: the report goes on
            notes.append(f"request {request_id}: the server's timeline is not kvpilot's ({type(exc).__name__}: {exc})")
            continue
        explained.append(replace(e, lines=(*e.lines, *client_lines(record))))
    return explained, notes
