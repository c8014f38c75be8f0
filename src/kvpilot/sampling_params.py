"""SamplingParams: how one request samples and when it stops (vLLM-compatible field names).

Torch-free: the scheduler reads the stop fields; the sampler reads the rest. Every field is range-checked
here, so that no value a client can send reaches the sampler (numpy columns, float32 tensors, seeded torch
generators) in a form that overflows or turns into inf/NaN there. The one check that needs the model,
stop_token_ids against the vocabulary, is made by LLMEngine.add_request.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from kvpilot.structured_outputs import StructuredOutputsParams

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's upper bound
MAX_TOKEN_ID = 2**31 - 1  # token ids are stored as int32 (the runner's persistent batch)
MAX_TOP_K = 2**31 - 1  # any value over the vocabulary size keeps every token
MIN_TEMPERATURE = 1e-2  # smaller positive temperatures are raised to it (as vLLM does): float32 overflows
# larger ones are lowered to it: past float32's range a temperature became inf and a banned token's -inf / inf a
# NaN probability; at 1e8 the allowed tokens are drawn practically uniformly, as at any larger temperature
MAX_TEMPERATURE = 1e8
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2  # beyond these float32 logits reach inf
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100  # OpenAI's range


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field and the allowed range."""


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings.

    Invariants (checked in __post_init__; SamplingParamsError names the field): integer fields are ints
    (not bools) and float fields finite real numbers; max_tokens >= 1, 0 <= min_tokens <= max_tokens,
    temperature == 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE] (one outside is moved to the nearer bound),
    0 < top_p <= 1, top_k 0 or -1 (off, as vLLM and HF accept) or 1..MAX_TOP_K, 0 <= min_p <= 1, repetition_penalty in
    [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY], presence/frequency penalties in [-2, 2],
    seed None or 0..MAX_SEED, stop strings non-empty, stop_token_ids in 0..MAX_TOKEN_ID,
    logprobs None or 0..MAX_LOGPROBS; logit_bias maps token ids (0..MAX_TOKEN_ID) to finite numbers in
    [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], added to the logits before sampling (OpenAI's semantics: -100 bans a
    token, +100 all but forces it); structured_outputs (a grammar the output must match; the request ends
    when the grammar is complete) excludes ignore_eos and min_tokens > 0, which would hold it past its end.
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
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_types()
        self._check_ranges()
        self._check_logit_bias()
        self._check_structured_outputs()
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.temperature = min(self.temperature, MAX_TEMPERATURE)

    def _check_types(self) -> None:
        for name in ("max_tokens", "top_k", "min_tokens"):
            _require_int(name, getattr(self, name))
        for name in ("seed", "logprobs"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            _require_finite(name, getattr(self, name))
        for token_id in self.stop_token_ids:
            _require_int("stop_token_ids", token_id)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingParamsError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}"[:300])

    def _check_ranges(self) -> None:
        bad_stop_ids = [t for t in self.stop_token_ids if not 0 <= t <= MAX_TOKEN_ID]
        checks = [
            (self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}"),
            (self.temperature >= 0, "temperature", f"must be >= 0 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}"),
            (-1 <= self.top_k <= MAX_TOP_K, "top_k", f"must be 0 or -1 (off) or 1..{MAX_TOP_K}, got {self.top_k}"),
            (0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}"),
            (MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
             f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] (1 = off), "
             f"got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"must be in [-2, 2], got {self.frequency_penalty}"),
            (self.seed is None or 0 <= self.seed <= MAX_SEED, "seed", f"must be in 0..2**64-1, got {self.seed}"),
            (not bad_stop_ids, "stop_token_ids", f"must be token ids (0..{MAX_TOKEN_ID}), got {bad_stop_ids[:5]}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"must be 0..{MAX_LOGPROBS}, got {self.logprobs}"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise SamplingParamsError(f"SamplingParams.{name} {message}")

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError(f"SamplingParams.logit_bias must map token ids to numbers, got "
                                      f"{type(self.logit_bias).__name__}")
        self.logit_bias = dict(self.logit_bias)
        for token_id, bias in self.logit_bias.items():
            _require_int("logit_bias", token_id)
            _require_finite("logit_bias", bias)
            if not 0 <= token_id <= MAX_TOKEN_ID:
                raise SamplingParamsError(f"SamplingParams.logit_bias keys must be token ids (0..{MAX_TOKEN_ID}), "
                                          f"got {token_id}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingParamsError(f"SamplingParams.logit_bias values must be in [-{MAX_LOGIT_BIAS}, "
                                          f"{MAX_LOGIT_BIAS}], got {bias} for token {token_id}")

    def _check_structured_outputs(self) -> None:
        spec = self.structured_outputs
        if spec is None:
            return
        if not isinstance(spec, StructuredOutputsParams):
            raise SamplingParamsError(f"SamplingParams.structured_outputs must be a StructuredOutputsParams, got "
                                      f"{type(spec).__name__}")
        if self.ignore_eos or self.min_tokens:
            raise SamplingParamsError("SamplingParams.structured_outputs cannot be combined with ignore_eos or "
                                      "min_tokens > 0 (the request ends when its grammar is complete): drop them")

    def check_vocab(self, vocab_size: int) -> None:
        """SamplingParamsError if a stop token id or logit_bias key is outside the model's vocabulary
        (0..vocab_size-1)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or {})):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(f"SamplingParams.{name} {bad[:5]} are outside the vocabulary "
                                          f"(0..{vocab_size - 1})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _require_int(name: str, value: Any) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise SamplingParamsError(f"SamplingParams.{name} must be an integer, got {value!r}"[:300])


def _require_finite(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise SamplingParamsError(f"SamplingParams.{name} must be a finite number, got {value!r}"[:300])
