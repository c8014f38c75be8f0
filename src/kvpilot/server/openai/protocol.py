"""Request bodies of /v1/completions and /v1/chat/completions (OpenAI shapes plus vLLM's extra fields).

Unknown fields are ignored (as vLLM does), so the official SDKs work unchanged. Known fields are strict, as
the OpenAI schema is: `"max_tokens": "8"`, `"stream": "yes"` or `prompt: [[false]]` are 400s, not coerced (an
integer is still accepted where a number is expected, and an integral number where an integer is: 8.0 is
JSON Schema's integer 8, and JavaScript cannot write them apart); numbers must be finite (JSON's NaN/Infinity are
refused); no string may hold a lone UTF-16 surrogate (it cannot be encoded, tokenized or echoed back).
Range checks of the sampling fields live in SamplingParams, so the server and the offline API reject the
same values with the same words; the checks that need the model (vocabulary, context length) are made
when the prompt is tokenized (prompt_tokens.py). The JSON schema (/openapi.json) states the same single-field
bounds (request_fields.py), so a client generated from it sends what the server accepts; rules between
fields (best_of >= n, min_tokens <= max_tokens, prompt plus max_tokens within the context, ...) it cannot.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from kvpilot.sampling_params import (MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_SEED, MAX_TOP_K, MIN_REPETITION_PENALTY,
                                     SamplingParams)
from kvpilot.server.openai.chat_messages import ChatMessages, template_messages
from kvpilot.server.openai.errors import APIError
from kvpilot.server.openai.request_fields import (LOGIT_BIAS_SCHEMA, PROMPT_SCHEMA, STOP_SCHEMA, TOKEN_ID_KEY, Int, TokenId,
                                           bounded, integral)
from kvpilot.server.openai.structured_protocol import StructuredFields, ToolFields

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
MAX_N = 128  # most choices (n) and candidates (best_of) per prompt: OpenAI's limit for n
NumChoices = Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(integral)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(integral)]
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


def reject_lone_surrogates(data: Any) -> Any:
    """`data` unchanged, or APIError 400 naming the first field whose text holds a lone surrogate (for
    request models other than the generation ones, e.g. tokenize_routes.py)."""
    path = _find_surrogate(data)
    if path is not None:
        param = ".".join(str(p) for p in path) or None
        raise APIError(400, f"{param}: the text holds a lone UTF-16 surrogate (e.g. \\ud800), which is not "
                            "valid Unicode: send well-formed UTF-8 text", param=param)
    return data


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """APIError 400 naming chat_template_kwargs when it would set a variable the server sets itself."""
    if not kwargs:
        return
    # imported here: the HTTP process's modules import no kvpilot.model module until a chat is rendered
    from kvpilot.model.chat_template import RESERVED_TEMPLATE_VARIABLES

    clash = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(kwargs or {}))
    if clash:
        raise APIError(400, f"chat_template_kwargs: {', '.join(clash)} cannot be set here: send them as the "
                            "request's own fields", param="chat_template_kwargs")


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _Sampling(StructuredFields):
    """Fields shared by both endpoints. `max_tokens` None means "up to max_model_len"."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        """A 400 naming the field (raised as APIError: pydantic passes it through to the error handler)."""
        return reject_lone_surrogates(data)

    model: str | None = None
    max_tokens: Int | None = bounded(minimum=1)
    temperature: float | None = bounded(minimum=0)
    top_p: float | None = bounded(exclusiveMinimum=0, maximum=1)
    top_k: Int | None = bounded(minimum=-1, maximum=MAX_TOP_K)
    min_p: float | None = bounded(minimum=0, maximum=1)
    repetition_penalty: float | None = bounded(minimum=MIN_REPETITION_PENALTY, maximum=MAX_REPETITION_PENALTY)
    presence_penalty: float | None = bounded(minimum=-2, maximum=2)
    frequency_penalty: float | None = bounded(minimum=-2, maximum=2)
    # 2**64 (exclusive): FastAPI writes bounds as floats, and 2**64 - 1 is not one
    seed: Int | None = bounded(minimum=0, exclusiveMaximum=MAX_SEED + 1)
    stop: Annotated[str | list[str] | None, WithJsonSchema(STOP_SCHEMA)] = None
    stop_token_ids: list[TokenId] | None = None
    logit_bias: Annotated[dict[str, float] | None, WithJsonSchema(LOGIT_BIAS_SCHEMA)] = None
    min_tokens: Int = Field(default=0, json_schema_extra={"minimum": 0})  # <= max_tokens: SamplingParams
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: NumChoices = 1  # choices per prompt: fanned out into engine requests (fanout.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Int = 0
    user: str | None = None
    # prefill/decode disaggregation (vLLM's field; engine/kv_transfer.py parses it): {"do_remote_decode": true}
    # on a prefill worker, the prefill response's kv_transfer_params on a decode worker
    kv_transfer_params: dict[str, Any] | None = None

    def logit_bias_ids(self) -> list[int]:
        """The token ids logit_bias names (APIError 400 for a key that is not one in ASCII digits)."""
        keys = list(self.logit_bias or {})
        if not all(TOKEN_ID_KEY.fullmatch(key) for key in keys):
            raise APIError(400, f"logit_bias: keys must be token ids (integers as strings), got {keys[:5]}",
                           param="logit_bias")
        return [int(key) for key in keys]

    def check_fields(self) -> None:
        """Rules between fields (each field's own range is checked by its type): 400s naming the field."""

    def candidates_per_prompt(self) -> int:
        """Engine requests per prompt: n (completions: best_of when set)."""
        return self.n

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
                              logprobs=logprobs, logit_bias=dict(zip(self.logit_bias_ids(),
                                                                     (self.logit_bias or {}).values())) or None,
                              structured_outputs=self.structured_outputs_params(), **given)


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: text, token ids, or a batch (a list of texts or of token-id lists: one
    choice per prompt and n, indexed prompt-major). `best_of`: candidates generated per prompt, of which the n
    with the highest cumulative logprob are returned (>= n; not with stream). `echo`: each choice's text
    starts with its prompt (not with logprobs: the engine computes no prompt logprobs). `suffix` (OpenAI's
    fill-in-the-middle) is refused, as vLLM refuses it, rather than ignored."""

    prompt: Annotated[str | list[int] | list[str] | list[list[int]], WithJsonSchema(PROMPT_SCHEMA)]
    logprobs: NumLogprobs | None = None
    echo: bool = False
    best_of: NumChoices | None = None
    suffix: Annotated[str | None, WithJsonSchema({"type": "null", "title": "Suffix",
                                                  "description": "Not supported (no fill-in-the-middle)."})] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _integral_ids(cls, prompt: Any) -> Any:
        """Token ids written as integral floats as ints (Int's rule; here, so the union keeps its plain names
        in errors: `list[int]`, ...)."""
        if not isinstance(prompt, list):
            return prompt
        return [[integral(t) for t in one] if isinstance(one, list) else integral(one) for one in prompt]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[Any]) -> str | list[Any]:
        """400 for an empty prompt (or an empty one in a batch), whatever the model's tokenizer would add."""
        batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        for index, one in enumerate(prompt if batch else [prompt]):
            if len(one) == 0:
                param = f"prompt.{index}" if batch else "prompt"
                raise APIError(400, f"{param}: the prompt is empty; send at least one token", param=param)
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or each of a batch (an empty list is one empty token prompt)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    def single_prompt(self) -> str | list[int]:
        """The one prompt of a request that is not a batch (serving.py splits a batch into such bodies)."""
        prompts = self.prompts()
        if len(prompts) != 1:
            raise APIError(400, f"prompt: a batch of {len(prompts)} prompts where one was expected",
                           param="prompt")
        return prompts[0]

    def check_fields(self) -> None:
        """400 naming the field: best_of below n, best_of > n with stream (candidates are ranked when all
        are done), suffix, echo with logprobs (prompt tokens have no logprobs here)."""
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of must be >= n, got best_of={self.best_of} and n={self.n}",
                           param="best_of")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise APIError(400, "best_of > n is not supported with stream=true: the best candidates are only "
                                "known when all have finished; leave best_of out or set stream=false",
                           param="best_of")
        if self.suffix is not None:
            raise APIError(400, "suffix is not supported: kvpilot generates after the prompt only (no "
                                "fill-in-the-middle); put the text in the prompt or leave suffix out", param="suffix")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo together with logprobs is not supported: kvpilot does not compute the "
                                "prompt tokens' logprobs; drop echo or logprobs", param="echo")

    def candidates_per_prompt(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    def default_max_tokens(self, room: int, cap: int | None = None) -> int:
        """OpenAI's 16 when unset (no more than the server's --max-tokens-default `cap`)."""
        return min(16, cap or 16) if self.max_tokens is None else self.max_tokens


class ChatCompletionRequest(_Sampling, ToolFields):
    """POST /v1/chat/completions. `logprobs` is a flag here, `top_logprobs` the count (OpenAI shape).
    `chat_template_kwargs` (vLLM's): more variables for the chat template, e.g. `{"enable_thinking": false}`
    for Qwen3; the ones the server sets itself (messages, tools, add_generation_prompt) are a 400."""

    messages: ChatMessages
    max_completion_tokens: Int | None = bounded(minimum=1)
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template receives them (chat_messages.py); the tools: template_tools()."""
        return template_messages(self.messages)

    def default_max_tokens(self, room: int, cap: int | None = None) -> int:
        """Unset: the room max_model_len leaves after the prompt (vLLM), at most the server's
        --max-tokens-default `cap` (None: no cap)."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if limit is not None:
            return limit
        return max(1, room) if cap is None else max(1, min(room, cap))

    def check_fields(self) -> None:
        """top_logprobs without logprobs: a 400, as OpenAI and vLLM answer (it would be ignored); max_tokens
        under 1 though max_completion_tokens (which wins) is valid: a 400 too, as the schema says."""
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise APIError(400, f"{name} must be >= 1, got {value}", param=name)
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, f"top_logprobs={self.top_logprobs} needs logprobs=true: set it, or leave "
                                "top_logprobs out", param="top_logprobs")
        check_template_kwargs(self.chat_template_kwargs)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
