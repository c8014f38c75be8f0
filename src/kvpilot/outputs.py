"""Results of the offline API, shaped like vLLM's (RequestOutput.outputs[0].text ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the top-N alternatives [(token_id, logprob)], best first."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass(slots=True)  # built for every running request every step: slots make that ~2x cheaper
class CompletionOutput:
    """One generated sequence. `finish_reason` is None while running, then "stop", "length", "abort" or
    "error" (the engine failed this request alone: RequestOutput.error says why).

    `logprobs` (when requested) has one entry per generated token id, aligned with `token_ids`.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step. Invariant: `finished` iff outputs[0].finish_reason is not None.

    `metrics` (kvpilot.engine.timeline.RequestMetrics), on the final output only (None before): queue,
    prefill, TTFT, decode, inter-token latencies, cached prompt tokens, preemptions. While a request runs, its
    outputs share the engine's live token lists (outputs[0].token_ids, logprobs): copy them to keep a
    snapshot; `delta_token_ids` / `delta_text` are what this step added.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: object | None = None
    num_cached_tokens: int = 0
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # set on the final output when finish_reason is "error"
    # a prefill request of disaggregation (engine/kv_transfer.py): where a decode worker pulls its KV (final only)
    kv_transfer_params: dict[str, Any] | None = None
