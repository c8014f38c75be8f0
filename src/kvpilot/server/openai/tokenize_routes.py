"""POST /tokenize and POST /detokenize, shaped like vLLM's.

/tokenize takes `{"model"?, "prompt", "add_special_tokens"?}` or `{"model"?, "messages", "tools"?,
"add_generation_prompt"?, "chat_template_kwargs"?, "add_special_tokens"?}` and answers `{"count", "max_model_len", "tokens"}`: exactly the ids a completion (or a
chat completion) of that prompt would run on (the same encode and chat template, BOS rule included;
`add_special_tokens` defaults to true for a prompt and false for messages, as in vLLM). A prompt longer than
max_model_len is still tokenized (that is what a client asks /tokenize to find out).
/detokenize takes `{"model"?, "tokens"}` and answers `{"prompt"}`, special tokens kept.

Validated like the generation routes: strict types, no lone surrogates, a 404 for an unknown model, 400 with
`param` for ids outside the vocabulary; 503 while the model loads. The work runs in the tokenizer pool,
never on the event loop. Both are behind the API key like every route but /health (auth.py).
"""

from __future__ import annotations

import sys
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, model_validator

from kvpilot.server.openai.chat_messages import ChatMessages, template_messages
from kvpilot.server.openai.errors import APIError
from kvpilot.server.prompt_tokens import encode, render_chat
from kvpilot.server.openai.protocol import check_template_kwargs, reject_lone_surrogates
from kvpilot.server.openai.request_fields import TokenId
from kvpilot.server.state import ServerState
from kvpilot.server.openai.structured_protocol import ToolDefinition, template_tools

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
# check()'s rules in the JSON schema: exactly one of a text prompt and a chat; tools only with the chat.
_PROMPT_OR_MESSAGES: dict[str, Any] = {"oneOf": [
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"},
                                            "tools": {"type": "null"}}},
    {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]}


class TokenizeRequest(BaseModel):
    """Exactly one of `prompt` and `messages` (400 naming `prompt` otherwise); `tools` only with `messages`.
    The schema's oneOf says the same."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, json_schema_extra=_PROMPT_OR_MESSAGES)

    model: str | None = None
    prompt: str | None = None
    messages: ChatMessages | None = None
    tools: list[ToolDefinition] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        return reject_lone_surrogates(data)

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "prompt: send either `prompt` (text) or `messages` (a chat), not "
                                f"{'both' if self.prompt is not None else 'neither'}", param="prompt")
        if self.tools is not None and self.messages is None:
            raise APIError(400, "tools: tools are rendered by the chat template, so they need `messages`; "
                                "leave them out with `prompt`", param="tools")
        check_template_kwargs(self.chat_template_kwargs)

    @property
    def size(self) -> int:
        """Characters to tokenize: picks the tokenizer pool's lane."""
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m.text()) for m in self.messages or [])


class DetokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    tokens: list[TokenId]  # in the vocabulary: checked by the route, which knows it

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        return reject_lone_surrogates(data)


def tokenize_ids(body: TokenizeRequest, tokenizer: Any) -> list[int]:
    """The ids of the prompt or chat (runs in a tokenizer pool worker; see prompt_tokens.encode)."""
    if body.messages is not None:
        conversation = template_messages(body.messages)
        try:
            text = render_chat(tokenizer, conversation, body.add_generation_prompt, template_tools(body.tools),
                               body.chat_template_kwargs)
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from exc
        add_special = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        add_special = body.add_special_tokens is not False
    ids = encode(tokenizer, text, add_special, sys.maxsize).token_ids
    return list(ids or [])


def detokenize_text(tokens: list[int], tokenizer: Any) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=False)


def _tokenizer(state: ServerState, param: str) -> Any:
    if state.tokenizer is None:
        raise APIError(400, f"{param}: this model has no tokenizer", param=param)
    return state.tokenizer


def add_tokenize_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """`{"count", "max_model_len", "tokens"}` of a prompt or a chat (see the module docstring)."""
        state.check_ready()
        state.check_model(body.model)
        body.check()
        tokenizer = _tokenizer(state, "messages" if body.messages is not None else "prompt")
        ids = await state.tokenizer_pool.run(body.size, tokenize_ids, body, tokenizer)
        return {"count": len(ids), "max_model_len": state.info.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """`{"prompt"}`: the text of the token ids, special tokens kept."""
        state.check_ready()
        state.check_model(body.model)
        vocab_size = state.info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"tokens: token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})",
                           param="tokens")
        tokenizer = _tokenizer(state, "tokens")
        return {"prompt": await state.tokenizer_pool.run(len(body.tokens), detokenize_text, body.tokens, tokenizer)}
