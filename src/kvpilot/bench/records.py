"""Typed contracts shared by the bench modules: what to send, and what one request measured.

All times in records are milliseconds; ``*_s`` fields are seconds on the run's clock (0 = run start).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Turn:
    """One user turn: the text to send and how many tokens to ask back.

    ``num_prompt_tokens`` is the token length of ``text`` alone (before chat templates or history),
    exact when the dataset was built with the model's tokenizer.
    """

    text: str
    num_prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class WorkItem:
    """A unit the load shape schedules: a single prompt, or a multi-turn chat session.

    Turns of one item run one after another, each carrying the history (earlier turns plus the
    server's answers). ``arrival_s`` is set only by trace replay (seconds after run start).
    ``group_id`` names the prefix group (shared-prefix) or the class ("long"/"short").
    """

    item_id: int
    turns: tuple[Turn, ...]
    group_id: str | None = None
    arrival_s: float | None = None
    messages: tuple[dict[str, str], ...] | None = None  # JSONL chat prompts sent verbatim (1 turn)


@dataclass(frozen=True)
class ServerTimings:
    """Per-request stage timings the kvpilot server reports (the ``"kvpilot"`` field), in ms."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    queue_ms: float
    tokenize_ms: float
    prefill_ms: float
    ttft_ms: float
    decode_ms: float
    serialize_ms: float
    e2e_ms: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    """Speculative decoding (the field's ``"speculation"`` object, absent when the request verified no drafts):
    verifications, tokens drafted, drafts accepted."""
    num_tier_cached_tokens: int = 0
    """Of ``num_cached_tokens``, those copied back from a KV offload tier (the field's ``tier_cached_tokens``,
    absent without offload) rather than found in the KV cache."""


@dataclass(frozen=True)
class RequestRecord:
    """Everything the client measured for one request.

    Invariants: ``ok`` implies ``status == 200`` and ``error is None``; ``ttft_ms`` and ``e2e_ms`` are
    measured from the moment the request was sent (after any client-side slot wait), so
    ``queue_wait_ms`` (waiting for a concurrency slot) is never inside TTFT. ``sched_lag_ms`` is how
    late the client dispatched the request versus its planned arrival (client overload, not server).
    """

    request_index: int
    item_id: int
    turn_index: int
    group_id: str | None
    ok: bool
    status: int | None
    error_kind: str | None
    error: str | None
    scheduled_s: float
    sent_s: float
    queue_wait_ms: float
    sched_lag_ms: float
    ttft_ms: float | None
    e2e_ms: float | None
    itl_ms: tuple[float, ...]
    num_prompt_tokens: int | None
    num_output_tokens: int
    output_tokens_source: str
    num_chunks: int
    retry_after_s: float | None = None
    server: ServerTimings | None = None
    output_text: str = field(default="", repr=False)
    replica: str | None = None
    """The replica that served it: the ``x-kvpilot-replica`` response header, else the replica URL bench sent
    it to when it spreads the load itself (``--replica-url`` without ``--base-url``); None otherwise."""
    num_output_words: int = 0
    num_copied_words: int = 0
    """Words of the answer, and those that continue a span of the prompt the client sent (bench.prompt_copy):
    what an n-gram drafter could have proposed."""
    num_usage_cached_tokens: int | None = None
    """Prompt tokens the server's prefix cache served, from the response's OpenAI ``usage.prompt_tokens_details.
    cached_tokens`` (vLLM with --enable-prompt-tokens-details, kvpilot); None when the usage does not say."""
    server_prompt_ms: float | None = None
    """How long the server says the prompt took, from its first batch to its last, without any wait before it
    (llama-server's ``timings.prompt_ms``, bench.client.engine_prompt_ms); None when the server does not say.
    Client TTFT minus this is what the request spent outside its prompt's compute: network, waiting for a
    slot or for the running batch, and client delay."""

    @property
    def tpot_ms(self) -> float | None:
        """vLLM's TPOT: (E2E - TTFT) / (output tokens - 1); None with fewer than 2 tokens."""
        if not self.ok or self.ttft_ms is None or self.e2e_ms is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.num_output_tokens - 1)

    @property
    def chunk_times_s(self) -> list[float]:
        """When each streamed chunk arrived, seconds on the run's clock (``sent_s``'s); empty without a first one."""
        if self.ttft_ms is None:
            return []
        first = self.sent_s + self.ttft_ms / 1000.0
        return [first + gap / 1000.0 for gap in itertools.accumulate((0.0, *self.itl_ms))]

    def to_json(self, include_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["itl_ms"] = list(self.itl_ms)
        d["tpot_ms"] = self.tpot_ms
        if not include_text:
            d.pop("output_text")
        return d


def record_from_json(d: dict[str, Any]) -> RequestRecord:
    """Inverse of :meth:`RequestRecord.to_json` (used by readers of result files)."""
    d = dict(d)
    d.pop("tpot_ms", None)
    server = d.pop("server", None)
    d["itl_ms"] = tuple(d.get("itl_ms", ()))
    d.setdefault("output_text", "")
    return RequestRecord(**d, server=ServerTimings(**server) if server else None)
