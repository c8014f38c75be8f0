"""Speculator: the scheduler's side of speculative decoding. Per step it prices a draft row (spec_cost.py);
per running decode it decides how many drafts pay (the request's acceptance, spec_acceptance.py) and asks
the proposer for them; after the step it learns from what the target accepted and how long the step took.

Drafts travel in SchedulerOutput.draft_token_ids; a request with k drafts computes 1 + k tokens in its
chunk (its last known token, then the drafts), which count against max_num_batched_tokens like any other.
"""

from __future__ import annotations

import time
from typing import Protocol

from kvpilot.engine.request import Request
from kvpilot.engine.scheduler_output import SchedulerOutput
from kvpilot.engine.spec_acceptance import AcceptanceTracker
from kvpilot.engine.spec_config import SpeculativeConfig
from kvpilot.engine.spec_cost import PRICE_CUTOFF, DraftCost, StepTimeModel, num_worthwhile_drafts
from kvpilot.sampling_params import SamplingParams


class DraftProposer(Protocol):
    """What the speculator asks of a proposer (ngram_proposer.NgramProposer): up to `max_drafts` guesses of
    the tokens that follow the request's known tokens (fewer, or none, when it has no good guess); `forget`
    drops a finished request's state."""

    def propose(self, request: Request, max_drafts: int) -> list[int]: ...

    def forget(self, request_id: str) -> None: ...


def speculation_eligible(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's drafts can be verified exactly: its next tokens' distributions must not depend on
    tokens still being verified. Penalties (output counts), structured outputs (the grammar's state) and a
    pending min_tokens (EOS masked by the output count) do; logprobs are reported per sampled token, which
    verification does not compute yet. Greedy and plain sampled requests (temperature, top-k/p, min-p,
    logit_bias, seeds) are eligible."""
    return (params.logprobs is None and params.structured_outputs is None
            and num_output_tokens >= params.min_tokens and params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0)


class Speculator:
    """Invariant: per-request state (acceptance, the proposer's tokens) only for requests not yet forgotten:
    the scheduler calls forget() when a request finishes."""

    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer) -> None:
        self.config = config
        self.proposer = proposer
        self.acceptance = AcceptanceTracker()
        self.step_times = StepTimeModel()
        self.draft_cost = DraftCost()

    def step_price(self, num_running: int) -> float | None:
        """The price of a draft row in this step (spec_cost.draft_price) with num_running decodes; None when
        no request may speculate (at or past disable_by_batch_size, or priced at PRICE_CUTOFF or more)."""
        cap = self.config.disable_by_batch_size
        if cap is not None and num_running >= cap:
            return None
        price = self.step_times.price(num_running, self.draft_cost.round_share)
        return price if price < PRICE_CUTOFF else None

    def drafts_for(self, request: Request, price: float, max_drafts: int) -> list[int]:
        """Up to max_drafts drafts for a running request whose tokens are all known (none in flight), as many
        as pay at this price; [] if none pay, it is not eligible, or the proposer has no guess."""
        if not speculation_eligible(request.sampling_params, len(request.output_token_ids)):
            return []
        rid = request.request_id
        k = num_worthwhile_drafts(self.acceptance.alpha(rid), price,
                                  min(max_drafts, self.config.num_speculative_tokens))
        if k == 0:
            self.acceptance.passed_over(rid)
            return []
        start = time.perf_counter()
        drafts = self.proposer.propose(request, k)
        request.draft_time += time.perf_counter() - start
        return drafts

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        self.acceptance.record(request_id, num_drafts, num_accepted)

    def observe_step(self, output: SchedulerOutput, seconds: float, draft_seconds: float = 0.0) -> None:
        """A finished step's wall time, of which draft_seconds computed its drafts (a draft model's rounds):
        those teach the draft cost; the rest, when the step was decode-only (decodes and verifications; a
        prompt chunk's cost is not a row's), the target's step time."""
        if draft_seconds > 0 and output.draft_token_ids:
            self.draft_cost.observe(draft_seconds, max(map(len, output.draft_token_ids.values())),
                                    len(output.draft_token_ids))
        num_sampled = output.num_sampled
        if output.new_requests or num_sampled != len(output.chunks) or not num_sampled:
            return
        if output.num_batched_tokens == num_sampled + output.num_draft_tokens:
            self.step_times.observe(output.num_batched_tokens, max(seconds - draft_seconds, 1e-9))

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self.proposer.forget(request_id)
