"""OpenAI response bodies and SSE chunks for both endpoints, as plain dicts (one place for the shapes)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from kvpilot.outputs import RequestOutput, TokenLogprob


class TokenText(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class ResponseShape:
    """What is fixed for one request's responses: endpoint kind, id, model, creation time."""

    chat: bool
    request_id: str
    model: str
    created: int

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None, *, chunk: bool,
               stop_reason: str | int | None = None, index: int = 0) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if not self.chat:
            choice["text"] = text
        elif chunk:
            choice["delta"] = {"content": text} if text or finish_reason is None else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return choice

    def body(self, choices: list[dict[str, Any]], usage: dict[str, Any], kvpilot: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(False), "choices": choices, "usage": usage, "kvpilot": kvpilot}

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        """One SSE event: `data: {json}\\n\\n`, the same text as sse() of the head, choices and extra in that
        order; the head's JSON is encoded once per request (a stream sends one chunk a token)."""
        body = self._chunk_prefix + _encode(choices)
        for key, value in extra.items():
            body += f",{_encode(key)}:{_encode(value)}"
        return body + "}\n\n"

    def running_chunk(self, text: str, logprobs: dict[str, Any] | None, index: int = 0) -> str:
        """chunk([choice(text, None, logprobs, chunk=True, index=index)]), the same text: the chunk a running
        stream sends each step, its JSON written around the encoded text (no dicts built and encoded)."""
        if logprobs is not None:
            return self.chunk([self.choice(text, None, logprobs, chunk=True, index=index)])
        return f"{self._running_prefix}{index},{self._running_middle}{_encode(text)}{self._running_end}"

    @cached_property
    def _running_prefix(self) -> str:
        return f'{self._chunk_prefix}[{{"index":'

    @cached_property
    def _running_middle(self) -> str:
        return '"logprobs":null,"finish_reason":null,' + ('"delta":{"content":' if self.chat else '"text":')

    @cached_property
    def _running_end(self) -> str:
        return "}}]}\n\n" if self.chat else "}]}\n\n"

    @cached_property
    def _chunk_prefix(self) -> str:
        head = _encode(self._head(True))
        return f'data: {head[:-1]},"choices":'

    def role_chunk(self, index: int = 0) -> str:
        """Chat streams open with the assistant role, one chunk per choice (as OpenAI's do)."""
        return self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])


# one encoder for every chunk: json.dumps with these settings builds a new JSONEncoder each call
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(payload: dict[str, Any]) -> str:
    return f"data: {_encode(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(output: RequestOutput) -> dict[str, Any]:
    """OpenAI usage with vLLM's prompt_tokens_details.cached_tokens (prefix-cache hits)."""
    return usage_of(len(output.prompt_token_ids), len(output.outputs[0].token_ids), output.num_cached_tokens)


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The usage object from its counts (a fanned-out request sums its sub-requests': fanout.usage_totals)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


MIN_LOGPROB = -9999.0  # what a non-finite logprob is sent as (vLLM's floor for -inf): JSON has no inf/NaN


def finite_logprob(logprob: float) -> float:
    """The logprob as JSON can carry it: -inf (a masked token) and any NaN/inf become MIN_LOGPROB."""
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _text(tokenizer: TokenText | None, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else f"<{token_id}>"


def completion_logprobs(entries: list[TokenLogprob], tokenizer: TokenText | None,
                        text_offset: int = 0) -> dict[str, Any]:
    """Legacy completions shape: tokens, token_logprobs, top_logprobs ({text: logprob}), text_offset."""
    tokens = [_text(tokenizer, e.token_id) for e in entries]
    offsets, position = [], text_offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": [finite_logprob(e.logprob) for e in entries],
            "top_logprobs": [{_text(tokenizer, t): finite_logprob(lp) for t, lp in e.top_logprobs}
                             for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], tokenizer: TokenText | None) -> dict[str, Any]:
    """Chat shape: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = _text(tokenizer, token_id)
        return {"token": text, "logprob": finite_logprob(logprob),
                "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top_logprobs]}
                        for e in entries]}
