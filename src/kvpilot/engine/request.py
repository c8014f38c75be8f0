"""Request: one generation's state as the scheduler sees it (status, tokens, progress, block table, timeline)."""

from __future__ import annotations

import enum

from kvpilot.engine.kv_transfer import PulledKV
from kvpilot.engine.timeline import RequestMetrics, Timeline
from kvpilot.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request finished; the value is the OpenAI `finish_reason` string."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the engine failed this request alone (a step that ran it by itself raised)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISHED_REASONS.get(self)

    @staticmethod
    def finished_with(reason: FinishReason) -> RequestStatus:
        return {v: k for k, v in _FINISHED_REASONS.items()}[reason]


_FINISHED_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One request's mutable state, owned by the engine and advanced by the scheduler.

    Invariants: all_token_ids == prompt_token_ids + output_token_ids; 0 <= num_computed_tokens <=
    num_tokens + num_output_placeholders (tokens whose K/V is, or is being, computed: the scheduler advances
    it when it schedules); num_output_placeholders counts tokens being sampled by steps in flight, whose ids
    are not known yet (0 or 1); block_ids covers at least num_computed_tokens tokens while RUNNING and is
    empty otherwise; num_cached_tokens is the prefix-cache hit (in tokens) at first admission.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        arrival_time: float,
        priority: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt: send at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0
        self.num_tier_cached_tokens = 0  # of num_cached_tokens, those copied back from a KV offload tier
        # disaggregation (engine/kv_transfer.py): hold the blocks for a decode worker once finished; K/V pulled
        # from a prefill worker, loaded at first admission (then None), and the tokens and seconds it saved
        self.hold_kv = False
        self.remote_kv: PulledKV | None = None
        self.num_kv_transfer_tokens = 0
        self.kv_transfer_time = 0.0
        self.block_ids: list[int] = []
        # KV groups 1.. of an interleaved model (engine/kv_groups.py): their tables, as long as block_ids
        self.extra_block_ids: list[list[int]] = []
        # Chained hashes of the full blocks of all_token_ids, extended by the KV manager as tokens arrive
        # (tokens are only appended, so they never go stale).
        self.block_hashes: list[int] = []
        self.num_preemptions = 0
        # speculative decoding: verifications, drafts verified, drafts the target accepted
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # seconds spent computing this request's drafts: its n-gram lookups, the draft model's steps that made them
        self.draft_time = 0.0
        self.timeline = Timeline(arrival=arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by generated tokens (read-only view by convention: append via append_output_token)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those being sampled in flight: what the next step may compute up to."""
        return len(self._all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.timeline.token_times.append(now)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keeps the first num_output_tokens generated tokens (and their stamps): a stop string matched inside
        the tokens one speculative step appended, and plain decoding would have stopped there. Only for a
        request about to finish: blocks and block hashes are not touched."""
        drop = len(self.output_token_ids) - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self._all_token_ids[len(self._all_token_ids) - drop:]
            del self.timeline.token_times[len(self.timeline.token_times) - drop:]

    def metrics(self) -> RequestMetrics:
        """Per-request metrics derived from the timeline (O(tokens): build it once, when the request ends)."""
        reason = self.finish_reason
        return RequestMetrics.from_timeline(
            self.timeline,
            request_id=self.request_id,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_tier_cached_tokens=self.num_tier_cached_tokens,
            num_kv_transfer_tokens=self.num_kv_transfer_tokens,
            kv_transfer_time=self.kv_transfer_time,
            num_preemptions=self.num_preemptions,
            finish_reason=reason.value if reason else None,
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            draft_time=self.draft_time,
        )
