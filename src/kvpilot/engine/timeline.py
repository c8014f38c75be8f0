"""A request's timeline (one stamp per state transition) and the per-request metrics derived from it.

Metrics, logs, response timings, bench and doctor all read this one timeline, so their numbers agree.
All stamps come from the scheduler's injected clock (seconds, monotonic by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One step's chunk of a request's prompt (or of its tokens recomputed after a preemption): the step's
    index in the scheduler's count, the tokens it computed, and when the step ran (start: the later of its
    scheduling and the previous step's end; end: when its output was applied). In a Timeline the times are
    clock seconds; in RequestMetrics, seconds after the request's arrival."""

    step_index: int
    num_tokens: int
    start: float
    end: float


@dataclass
class Timeline:
    """Stamps of one request's life, in clock seconds.

    Invariants: arrival <= tokenized <= first_scheduled <= token_times[0] <= ... <= finished when set;
    token_times has one entry per generated token (kept across preemptions); preempted_times and
    resumed_times have one entry per preemption / re-admission; prefill_chunks in step order, one per step
    that computed prompt or recomputed tokens of it; queued_step is the index of the first step scheduled
    after the request was queued (so every step from it to its first token's ran while it waited).
    """

    arrival: float
    tokenized: float | None = None  # set by the caller (engine / server) after tokenizing the prompt
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    preempted_times: list[float] = field(default_factory=list)
    resumed_times: list[float] = field(default_factory=list)
    finished: float | None = None
    queued_step: int | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def last_token(self) -> float | None:
        return self.token_times[-1] if self.token_times else None


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request timings (seconds) and counts, derived from a Timeline; None where a stage was not reached.

    queue_time: first scheduled - queued (tokenized, else arrival); prefill_time: first token - first scheduled;
    ttft: first token - arrival; decode_time: last token - first token; e2e_latency: finished - arrival.
    Speculative decoding: num_drafts verifications of num_draft_tokens drafts, num_accepted_tokens of them
    accepted by the target (all 0 without speculation), draft_time the seconds spent computing its drafts
    (n-gram lookups; a draft model's steps, each counted whole for every request it drafted for); tokens
    accepted in one step share its stamp. num_tier_cached_tokens: of num_cached_tokens (the prefix hit at
    first admission), those copied back from a KV offload tier rather than found in the pool;
    num_kv_transfer_tokens: of num_cached_tokens, those pulled from a prefill worker (disaggregation), in
    kv_transfer_time seconds. queued_step and prefill_chunks (times after arrival) as in the Timeline: which
    steps the request waited through and what each of its prompt's chunks computed.
    """

    request_id: str
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    finish_reason: str | None
    tokenize_time: float | None
    queue_time: float | None
    prefill_time: float | None
    ttft: float | None
    decode_time: float | None
    e2e_latency: float | None
    inter_token_latencies: tuple[float, ...]
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_time: float = 0.0
    num_tier_cached_tokens: int = 0
    num_kv_transfer_tokens: int = 0
    kv_transfer_time: float = 0.0
    queued_step: int | None = None
    prefill_chunks: tuple[PrefillChunk, ...] = ()

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted drafts / drafted tokens; None when the request verified no draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @classmethod
    def from_timeline(
        cls,
        timeline: Timeline,
        *,
        request_id: str,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        num_preemptions: int,
        finish_reason: str | None,
        num_tier_cached_tokens: int = 0,
        num_kv_transfer_tokens: int = 0,
        kv_transfer_time: float = 0.0,
        num_drafts: int = 0,
        num_draft_tokens: int = 0,
        num_accepted_tokens: int = 0,
        draft_time: float = 0.0,
    ) -> RequestMetrics:
        t = timeline
        queued = t.tokenized if t.tokenized is not None else t.arrival
        times = t.token_times
        return cls(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            num_generated_tokens=len(times),
            num_cached_tokens=num_cached_tokens,
            num_preemptions=num_preemptions,
            finish_reason=finish_reason,
            tokenize_time=_diff(t.tokenized, t.arrival),
            queue_time=_diff(t.first_scheduled, queued),
            prefill_time=_diff(t.first_token, t.first_scheduled),
            ttft=_diff(t.first_token, t.arrival),
            decode_time=_diff(t.last_token, t.first_token),
            e2e_latency=_diff(t.finished, t.arrival),
            inter_token_latencies=tuple(b - a for a, b in zip(times, times[1:])),
            num_drafts=num_drafts,
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens,
            draft_time=draft_time,
            num_tier_cached_tokens=num_tier_cached_tokens,
            num_kv_transfer_tokens=num_kv_transfer_tokens,
            kv_transfer_time=kv_transfer_time,
            queued_step=t.queued_step,
            prefill_chunks=tuple(replace(c, start=c.start - t.arrival, end=c.end - t.arrival)
                                 for c in t.prefill_chunks),
        )
