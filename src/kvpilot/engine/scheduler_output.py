"""The step contract between the scheduler and the model runner: a diff of new and running requests, and
what the runner sends back.

Everything here is plain data (ints, strs, lists, SamplingParams): cheap to build, and picklable, so it can
cross a process boundary. The records built per request per step use slots and are not frozen (a frozen
dataclass costs ~3x to construct); treat them as read-only all the same. The runner keeps its own per-request state (token ids, block table rows, sampling
settings) and updates it from these diffs; nothing here grows with a request's context or output length
except the one-time NewRequestData.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.kv_offload import OffloadOrders
from kvpilot.engine.kv_transfer import KVLoad
from kvpilot.engine.request import FinishReason
from kvpilot.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has no state for: first admitted, or resumed after a preemption.

    Invariants: block_ids is the whole block table and covers num_computed_tokens + the step's scheduled
    tokens; with a sliding window its leading entries may be kv_manager.NULL_BLOCK_ID, placeholders for
    blocks wholly before the window that attention never reads; output_token_ids is empty unless the
    request was preempted (then its tokens are recomputed as if they were prompt, but still count as outputs
    for penalties and min_tokens). extra_block_ids: with KV groups (engine/kv_groups.py) the tables of groups
    1.., each as long as block_ids; () otherwise.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # before this step: the prefix-cache hit
    extra_block_ids: tuple[list[int], ...] = ()


@dataclass(slots=True)
class RunningRequestData:
    """A request the runner already holds, scheduled again: only what changed since its last step. Blocks the
    KV manager released from a sliding window are not announced: the runner's row keeps their old ids,
    which attention must not read (kv_manager's module docstring)."""

    request_id: str
    new_block_ids: list[int]  # appended to its block table (usually empty for a decode)
    num_computed_tokens: int  # before this step
    new_extra_block_ids: tuple[list[int], ...] = ()  # KV groups 1..: as many new blocks each, when any


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: num_tokens tokens from start_position (its computed tokens before the
    step). needs_sample: the chunk reaches the request's last token, so the runner samples one new token;
    False for a prompt chunk that is not the last (chunked prefill)."""

    request_id: str
    start_position: int
    num_tokens: int
    needs_sample: bool

    @property
    def is_decode(self) -> bool:
        """One token after earlier ones (a one-token prompt is a prefill): the runner's and step stats' rule."""
        return self.num_tokens == 1 and self.start_position > 0


@dataclass(frozen=True)
class SchedulerOutput:
    """One step, as a diff. chunks: running requests' chunks first, in the order of running_requests, then
    newly admitted / resumed ones; every chunk's request is in exactly one of new_requests and running_requests.

    Invariants: num_batched_tokens == sum of chunk.num_tokens <= max_num_batched_tokens; num_sampled == the
    number of chunks with needs_sample; len(chunks) <= max_num_seqs. finished_request_ids lists requests
    finished or aborted since the last step and preempted_request_ids those preempted in this one: the runner
    drops their state before running the step.

    Speculative decoding: draft_token_ids maps a running request to its k drafts for this step; its chunk then
    computes 1 + k tokens (its last known token at start_position, the drafts after it), needs_sample is
    True, and the runner verifies the drafts (RunnerOutput.verified_token_ids). trimmed_tables maps a request
    whose block table the KV manager cut after rejected drafts to the blocks it kept: the runner cuts its row
    to that many before appending this step's new blocks.

    KV offload: `offload` carries the step's copy orders between the pool and the offload tiers
    (engine/kv_offload.py: saves of blocks about to be reused, loads of blocks a prefix hit found in a tier);
    the runner executes them before anything else of the step (None: nothing to copy). Disaggregation:
    `kv_loads` carries K/V pulled from a prefill worker into new blocks (engine/kv_transfer.py), copied by the
    runner right after the offload orders.

    step_index counts the scheduler's steps from 0 and scheduled_at is its clock when it built this one (for
    the requests' timelines; -1 and 0.0 in a diff built by hand).
    """

    chunks: list[ScheduledChunk]
    new_requests: list[NewRequestData] = field(default_factory=list)
    running_requests: list[RunningRequestData] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    # The scheduler counts these while it builds the step, so a decode step is known without a pass over
    # its chunks; -1 (a diff built by hand): counted here.
    num_batched_tokens: int = -1
    num_sampled: int = -1
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    trimmed_tables: dict[str, int] = field(default_factory=dict)
    offload: OffloadOrders | None = None
    kv_loads: tuple[KVLoad, ...] = ()
    step_index: int = -1
    scheduled_at: float = 0.0

    def __post_init__(self) -> None:
        if self.num_batched_tokens < 0:
            object.__setattr__(self, "num_batched_tokens", sum(c.num_tokens for c in self.chunks))
        if self.num_sampled < 0:
            object.__setattr__(self, "num_sampled", sum(1 for c in self.chunks if c.needs_sample))

    @property
    def is_all_decode(self) -> bool:
        """Every chunk one sampled token after earlier ones (no new request: a running one has computed tokens),
        known from the counts without a pass over the chunks."""
        return self.num_batched_tokens == self.num_sampled == len(self.chunks) and not self.new_requests

    @property
    def num_decode_tokens(self) -> int:
        """Decodes' tokens: one per plain decode, 1 + k per verification of k drafts."""
        # ScheduledChunk.is_decode, inlined: this runs over every chunk of every step the server reports
        plain = sum(1 for c in self.chunks if c.num_tokens == 1 and c.start_position > 0)
        return plain + len(self.draft_token_ids) + self.num_draft_tokens if self.draft_token_ids else plain

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.draft_token_ids.values())) if self.draft_token_ids else 0


@dataclass(slots=True)
class SampledToken:
    """One request's sampled token; with logprobs requested, its log-probability and the top-N alternatives."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(frozen=True)
class RunnerOutput:
    """What one step produced, in one message: token_ids, the sampled token of every chunk with needs_sample,
    by request id; logprobs, by request id, the SampledToken (with its logprob and top alternatives) of those
    of them that asked for logprobs, and no others. Plain ids for the rest: no object per request per step.
    failed: requests the runner failed alone in this step (request id -> why, a bounded message; their grammar
    failed, model/grammar_state.py): the engine finishes them with reason "error" and discards their tokens.
    verified_token_ids: for each request that had drafts, every token the verification emitted, the accepted
    drafts then the target's own next token (1 .. k + 1 tokens; token_ids holds the first of them).
    draft_seconds: what computing the step's drafts took in the runner (a draft model's steps; 0 for n-grams,
    which the scheduler proposes itself). beside_seconds: what the copy of the step's beside loads (KV offload
    prefetches) took in the runner's copy thread (0: none, or a CUDA side stream the host did not time)."""

    token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, SampledToken] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_seconds: float = 0.0
    beside_seconds: float = 0.0


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request, for the engine to detokenize and emit.

    new_token_ids holds the token sampled this step, or with speculation every token the step emitted up to
    the first that finished the request (stop tokens and EOS included: the detokenizer decides what text they
    produce); finish_reason is set when the request finished in this step.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
