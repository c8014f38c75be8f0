"""SamplingParams: how one request samples and when it stops (vLLM-compatible field names).

Torch-free: the scheduler reads the stop fields; the sampler reads the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field and the allowed range."""


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings.

    Invariants (checked in __post_init__): max_tokens >= 1, 0 <= min_tokens <= max_tokens,
    temperature >= 0 (0 means greedy), 0 < top_p <= 1, top_k == -1 or >= 1, 0 <= min_p <= 1,
    repetition_penalty > 0, logprobs is None or 0..20.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check()

    def _check(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}"),
            (self.temperature >= 0, "temperature", f"must be >= 0 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (off) or >= 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", f"must be 0..20, got {self.logprobs}"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise SamplingParamsError(f"SamplingParams.{name} {message}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
