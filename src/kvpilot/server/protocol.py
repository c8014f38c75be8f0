"""Request bodies of /v1/completions and /v1/chat/completions (OpenAI shapes plus vLLM's extra fields).

Unknown fields are ignored (as vLLM does), so the official SDKs work unchanged. Known fields are strict, as
the OpenAI schema is: `"max_tokens": "8"`, `"stream": "yes"` or `prompt: [[false]]` are 400s, not coerced (an
integer is still accepted where a number is expected); numbers must be finite (JSON's NaN/Infinity are
refused); no string may hold a lone UTF-16 surrogate (it cannot be encoded, tokenized or echoed back).
Range checks of the sampling fields live in SamplingParams, so the server and the offline API reject the
same values with the same words; the checks that need the model (vocabulary, context length) are made
when the prompt is tokenized (prompt_tokens.py).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpilot.sampling_params import SamplingParams
from kvpilot.server.errors import APIError

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _find_surrogate(value: Any, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """The path of the first string (or key) in a JSON value that holds a lone surrogate, else None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _SURROGATE.search(key):
            return (*path, key)
        found = _find_surrogate(item, (*path, key))
        if found is not None:
            return found
    return None


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints. `max_tokens` None means "up to max_model_len"."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        """A 400 naming the field (raised as APIError: pydantic passes it through to the error handler)."""
        path = _find_surrogate(data)
        if path is not None:
            param = ".".join(str(p) for p in path) or None
            raise APIError(400, f"{param}: the text holds a lone UTF-16 surrogate (e.g. \\ud800), which is not "
                                "valid Unicode: send well-formed UTF-8 text", param=param)
        return data

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None

    def logit_bias_ids(self) -> list[int]:
        """The token ids logit_bias names (APIError 400 for a key that is not an integer)."""
        try:
            return [int(key) for key in self.logit_bias or {}]
        except ValueError:
            raise APIError(400, "logit_bias: keys must be token ids (integers as strings), got "
                                f"{list(self.logit_bias or {})[:5]}", param="logit_bias") from None

    def check_n(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n must be 1 (kvpilot returns one choice per request), got {self.n}", param="n")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams with OpenAI defaults (temperature 1); SamplingParamsError names a bad field."""
        given: dict[str, Any] = {k: getattr(self, k) for k in (
            "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "stop_token_ids") if getattr(self, k) is not None}
        return SamplingParams(max_tokens=max_tokens, stop=self.stop or [], min_tokens=self.min_tokens,
                              ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
                              logprobs=logprobs, **given)


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: text, token ids, or a one-element list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: batches of {len(prompt)} prompts are not supported; send one "
                                    "prompt per request", param="prompt")
            prompt = prompt[0]
        if self.echo:
            raise APIError(400, "echo is not supported: leave it false", param="echo")
        return prompt  # type: ignore[return-value]

    def default_max_tokens(self, room: int) -> int:
        return 16 if self.max_tokens is None else self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Content as plain text; list content keeps only its text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. `logprobs` is a flag here, `top_logprobs` the count (OpenAI shape)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def default_max_tokens(self, room: int) -> int:
        """Like vLLM: unset means whatever room max_model_len leaves after the prompt."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return max(1, room) if limit is None else limit

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
