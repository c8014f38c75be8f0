"""Chat messages of a request, and the shape the chat template receives them in.

OpenAI's shapes in: an assistant message may carry `tool_calls` (its content may then be null); a `tool`
message answers one call, `tool_call_id` naming it (optional, as vLLM accepts it); any message may have a
`name`. transformers' shape out (`template_message`): the same keys, except that a call's
`function.arguments` is a dict where the JSON string parses to one (chat templates commonly read arguments
as a mapping; vLLM converts them the same way) and content is always a string ("" for null), so templates
that concatenate it never meet None. Every field named here reaches the template; other fields (e.g. the
`refusal` or `audio` an SDK echoes back with an assistant message) are accepted and not passed on. List
content is text parts only ('text', and the 'refusal' of an assistant turn an SDK echoes back): an image, audio
or file part is a 400 naming it, since the models served here read text only and dropping it would answer
another question than the one asked."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
# content part types the template receives, each with the key holding its text
_TEXT_KEYS = {"text": "text", "refusal": "refusal"}


class MessageFunctionCall(BaseModel):
    """The function an earlier assistant turn called. `arguments`: OpenAI sends a JSON string; a JSON
    object is accepted too."""

    model_config = _STRICT

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    model_config = _STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall

    def template_call(self) -> dict[str, Any]:
        """transformers' shape: arguments as a dict when the JSON string holds an object."""
        arguments: Any = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        call: dict[str, Any] = {"id": self.id} if self.id is not None else {}
        return call | {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    """One message. Invariants: `tool_calls` only on an assistant message, `tool_call_id` only on a tool
    message (else a 400 naming the message, `param: messages.<i>`: they would otherwise be dropped without
    a word)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for index, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type")
            key = _TEXT_KEYS.get(kind) if isinstance(kind, str) else None
            if key is None:
                raise PydanticCustomError("content_part", f"content part {index} has type {kind!r}: the models "
                                                          "served here read text only; send 'text' parts or a string")
            if not isinstance(part.get(key), str):
                raise PydanticCustomError("content_part", f"content part {index} of type {kind!r} needs a string "
                                                          f"{key!r}")
        return content

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_fields", f"tool_calls belong on an assistant message, not on a "
                                                     f"{self.role!r} one: move them to the turn that made the calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise PydanticCustomError("tool_fields", f"tool_call_id belongs on a 'tool' message, not on a "
                                                     f"{self.role!r} one: send a call's result as role 'tool'")
        return self

    def text(self) -> str:
        """Content as plain text: list content's parts joined (all are text: _text_parts_only)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part[_TEXT_KEYS[part["type"]]] for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template receives it (transformers' shape, see the module docstring)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.template_message() for m in messages]
