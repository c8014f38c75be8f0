"""The contract between the scheduler and the model runner / engine loop: what to compute this step, and
what came of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.request import FinishReason


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step.

    token_ids are computed at positions start_position .. start_position + len(token_ids) - 1; the runner
    writes the K/V of position p to slot block_ids[p // block_size] * block_size + p % block_size.
    block_ids is the request's whole block table and covers start_position + len(token_ids) tokens.
    needs_sample is True when the chunk ends at the request's last known token (sample one new token);
    False for a prompt chunk that is not the last one (chunked prefill).
    """

    request_id: str
    token_ids: list[int]  # a prompt chunk, or the one last sampled token
    start_position: int  # == request.num_computed_tokens before the step
    block_ids: list[int]
    needs_sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One token after earlier ones (a one-token prompt is a prefill): the runner's and step stats' rule."""
        return len(self.token_ids) == 1 and self.start_position > 0


@dataclass(frozen=True)
class SchedulerOutput:
    """One step. chunks: running requests' chunks first, then newly admitted / resumed ones.

    Invariant: num_batched_tokens == sum of len(chunk.token_ids) <= max_num_batched_tokens, and
    len(chunks) <= max_num_seqs. finished_request_ids lists requests finished or aborted since the last
    step, preempted_request_ids those preempted in this one: the runner may drop their per-request state.
    """

    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class RequestUpdate:
    """What one step did to one request, for the engine to detokenize and emit.

    new_token_ids holds the token sampled this step (stop tokens and EOS included: the detokenizer decides
    what text they produce); finish_reason is set when the request finished in this step.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
