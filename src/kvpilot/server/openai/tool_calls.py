"""Tool calls: the grammar a forced `tool_choice` asks for, and the output turned into `message.tool_calls`.

vLLM's conventions: a named function (`{"type": "function", "function": {"name": ...}}`) constrains the
output to that function's `parameters` schema, so the text *is* the call's arguments; "required"
constrains it to a JSON array of one or more `{"name": ..., "parameters": {...}}` objects, one of the
tools each (at most one with parallel_tool_calls false). The arguments hold only the keys their schema lists,
each at most once, as OpenAI's strict mode has it (disable_additional_properties: an object schema that lists
`properties` admits no other key unless it says so with `additionalProperties`). A call that ran to completion
is answered with content null, `tool_calls` and finish_reason "tool_calls"; one cut short by max_tokens keeps
finish_reason "length" (its arguments are then incomplete JSON, as OpenAI's are).

"auto" (on by default where the chat template allows it: auto_tool_choice.py) constrains nothing: the
parser reads the calls out of the finished text (hermes_tool_parser.py). With calls, the answer has
`tool_calls`, the text around them as content (null when there is none) and finish_reason "tool_calls";
without, it is an ordinary answer. A stream sends the text as content until a call's opening marker (or
what may become one) appears; from there serving.py holds the text back, and the last chunk carries the
calls and any content after them (parsed from the held-back part alone).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from kvpilot.server.openai.tool_parsers import TOOL_CALL_MARKERS, TOOL_CALL_PARSERS
from kvpilot.structured_outputs import StructuredOutputsParams

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCallPlan:
    """What one request's tool_choice asks for. Invariants: parameters maps each offered function's name to
    its parameters schema; `named` is one of its keys, or None for "required" and "auto"; `parser` is None
    (a forced call) or, for "auto", the name of a parser in TOOL_CALL_PARSERS (then `named` is None and
    nothing is constrained)."""

    parameters: dict[str, dict[str, Any]]
    named: str | None = None
    parallel: bool = True
    parser: str | None = None

    def spec(self) -> StructuredOutputsParams | None:
        """The grammar of a forced call; None for "auto" (the output stays free)."""
        if self.parser is not None:
            return None
        if self.named is not None:
            return StructuredOutputsParams(json=self.parameters[self.named], disable_additional_properties=True)
        choices = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                     "parameters": schema},
                    "required": ["name", "parameters"], "additionalProperties": False}
                   for name, schema in self.parameters.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": choices[0] if len(choices) == 1 else {"anyOf": choices}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, disable_additional_properties=True)

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The tool_calls entries of a finished forced output; None when the text holds none (cut short)."""
        if self.named is not None:
            return [_call(self.named, text)]
        try:
            items = json.loads(text)
        except ValueError:
            return None
        if not isinstance(items, list):
            return None
        return [_call(str(item.get("name")), json.dumps(item.get("parameters", {}), ensure_ascii=False))
                for item in items if isinstance(item, dict)]

    def parsed(self, text: str) -> tuple[list[dict[str, Any]] | None, str | None]:
        """(the tool_calls entries or None, the content besides them) of a finished output."""
        if self.parser is None:
            return self.calls(text), None
        found = TOOL_CALL_PARSERS[self.parser](text, self.parameters.keys())
        calls = [_call(call.name, call.arguments) for call in found.calls]
        if not self.parallel:  # parallel_tool_calls false: the first call only (the grammar of a forced one)
            calls = calls[:1]
        return (calls or None), (found.content or None)

    def shape_message(self, choice: dict[str, Any], text: str, finish_reason: str | None) -> dict[str, Any]:
        """A non-streaming chat choice with the calls in `message.tool_calls` (unchanged without calls)."""
        calls, content = self.parsed(text)
        if calls is None:
            return choice
        message = {**choice["message"], "content": content, "tool_calls": calls}
        return {**choice, "message": message, "finish_reason": _finish(finish_reason)}

    def streamable(self, text: str, start: int = 0) -> int:
        """How many leading characters of the answer so far may stream as content: none for a forced call
        (the text is the call); under "auto", all before the parser's call marker, holding back an end that
        may still become one. Invariant: never decreases as `text` grows, so a caller that already streamed
        `start` characters (an earlier answer of this method) lets the search begin there."""
        if self.parser is None:
            return 0
        marker = TOOL_CALL_MARKERS[self.parser]
        at = text.find(marker, start)
        if at >= 0:
            return at
        for keep in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def final_delta(self, choice: dict[str, Any], text: str, finish_reason: str | None,
                    num_streamed: int = 0) -> dict[str, Any]:
        """The last streamed chunk's choice: the text not streamed yet (after `num_streamed` characters sent as
        content), every call in one `delta.tool_calls`."""
        held = text[num_streamed:]
        calls, content = self.parsed(held)
        if calls is None:
            return {**choice, "delta": {"content": held} if held else {}}
        delta: dict[str, Any] = {"content": content} if content else {}
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return {**choice, "delta": delta, "finish_reason": _finish(finish_reason)}


def _finish(finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
