"""Chat messages of a request, and the shape the chat template receives them in.

OpenAI's shapes in, checked per role as OpenAI checks them (`check_roles`: a 400 naming the field, as a
message without what its role needs would reach the model as an empty turn): `system`, `developer` and
`user` messages need content, an `assistant` one content or a non-empty `tool_calls`, a `tool` one content
and the `tool_call_id` of the call it answers; `tool_calls` belong on assistant messages only, `tool_call_id`
on tool ones; any message may have a `name`. Content is a string or a non-empty list of parts. The JSON
schema (/openapi.json) states the same rules (`_message_schema`).

transformers' shape out (`template_message`): the same keys, except that a call's `function.arguments` is a
dict where the JSON string parses to one (chat templates commonly read arguments as a mapping; vLLM converts
them the same way) and content is always a string ("" for an assistant turn with tool calls only), so
templates that concatenate it never meet None. Every field named here reaches the template; other fields
(e.g. the `refusal` or `audio` an SDK echoes back with an assistant message) are accepted and not passed on.
List content is text parts only ('text', and the 'refusal' of an assistant turn an SDK echoes back): an
image, audio or file part is a 400 naming it, since the models served here read text only and dropping it
would answer another question than the one asked."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from kvpilot.server.openai.errors import APIError

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
# content part types the template receives, each with the key holding its text
_TEXT_KEYS = {"text": "text", "refusal": "refusal"}


@dataclass(frozen=True)
class RoleRule:
    """What a message of one role must carry (OpenAI's rules). Invariant: `needs` are fields that must be
    present and not null; with `content_or_calls` the message needs content or a non-empty `tool_calls`."""

    needs: tuple[str, ...] = ()
    content_or_calls: bool = False


ROLE_RULES: dict[str, RoleRule] = {
    "system": RoleRule(needs=("content",)), "developer": RoleRule(needs=("content",)),
    "user": RoleRule(needs=("content",)), "assistant": RoleRule(content_or_calls=True),
    "tool": RoleRule(needs=("content", "tool_call_id")),
}
_NEEDED = {"content": "content (a string or a non-empty list of text parts)",
           "tool_call_id": "tool_call_id (the id of the assistant's tool call it answers)"}
# only these roles may carry these fields (else they would be dropped without a word), and what to do instead
_ONLY_ON = {"tool_calls": "assistant", "tool_call_id": "tool"}
_MISPLACED = {"tool_calls": "tool_calls belong on an assistant message, not on a {role!r} one: move them to the "
                            "turn that made the calls",
              "tool_call_id": "tool_call_id belongs on a 'tool' message, not on a {role!r} one: send a call's "
                              "result as role 'tool'"}
_TEXT_PART_SCHEMA: dict[str, Any] = {"oneOf": [
    {"type": "object", "required": ["type", key], "properties": {"type": {"const": kind}, key: {"type": "string"}}}
    for kind, key in _TEXT_KEYS.items()]}


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


def _message_schema(schema: dict[str, Any]) -> None:
    """The JSON schema of a message says what the validators accept: content's parts, and each role's rules
    (one branch per role; a field a role must not carry is null there)."""
    schema["properties"]["content"] = {"title": "Content", "anyOf": [
        {"type": "string"}, {"type": "array", "minItems": 1, "items": _TEXT_PART_SCHEMA}, {"type": "null"}]}
    present = {"content": {"not": {"type": "null"}}, "tool_call_id": {"type": "string"}}
    branches = []
    for role, rule in ROLE_RULES.items():
        properties: dict[str, Any] = {"role": {"const": role}}
        properties |= {field: {"type": "null"} for field, owner in _ONLY_ON.items() if owner != role}
        properties |= {field: present[field] for field in rule.needs}
        branch: dict[str, Any] = {"properties": properties, "required": ["role", *rule.needs]}
        if rule.content_or_calls:
            branch["anyOf"] = [{"required": ["content"], "properties": {"content": present["content"]}},
                               {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array",
                                                                                          "minItems": 1}}}]
        branches.append(branch)
    schema["oneOf"] = branches


class ChatMessage(BaseModel):
    """One chat message, OpenAI's shape. The types of its fields are checked here; what each role needs, by
    check_roles (it knows the message's index, so its 400 names the field: `param: messages.<i>.<field>`)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, json_schema_extra=_message_schema)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(content, list) and not content:
            raise PydanticCustomError("content_part", "content is an empty list of parts: send a string or at "
                                                      "least one text part")
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


def check_roles(messages: list[ChatMessage]) -> list[ChatMessage]:
    """`messages` unchanged, or APIError 400 naming the first field that breaks its role's rule (ROLE_RULES,
    _ONLY_ON): a message without what its role needs would be sent to the model as an empty turn."""
    for index, message in enumerate(messages):
        where, role = f"messages.{index}", message.role
        for field, owner in _ONLY_ON.items():
            if getattr(message, field) is not None and role != owner:
                raise APIError(400, f"{where}.{field}: {_MISPLACED[field].format(role=role)}",
                               param=f"{where}.{field}")
        rule = ROLE_RULES[role]
        for field in rule.needs:
            if getattr(message, field) is None:
                raise APIError(400, f"{where}.{field}: a {role!r} message needs {_NEEDED[field]}",
                               param=f"{where}.{field}")
        if rule.content_or_calls and message.content is None and not message.tool_calls:
            raise APIError(400, f"{where}.content: an {role!r} message needs content or tool_calls (a "
                                "non-empty list)", param=f"{where}.content")
    return messages


# The messages of a request: at least one, each checked against its role's rules.
ChatMessages = Annotated[list[ChatMessage], Field(min_length=1), AfterValidator(check_roles)]


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.template_message() for m in messages]
