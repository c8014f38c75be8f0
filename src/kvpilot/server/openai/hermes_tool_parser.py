"""`--tool-call-parser hermes`: tool calls read out of a finished answer written in the Hermes format.

A call is a block `<tool_call>{"name": "<function>", "arguments": {...}}</tool_call>` anywhere in the text
(Hermes and Qwen models write them so; kvpilot's tools section asks for them: tool_prompt.py). A block
becomes a call when its body is a JSON object with a string `name` (one of the offered functions, when
they are given) and `arguments` that are an object, or a JSON string of one, or absent (`{}`);
`parameters` is read as a synonym. Anything else stays in the text as it was written, tags included:
malformed JSON, an unknown function, a block cut short by max_tokens, a block that is not closed before
the next one opens. The last block may lack its closing tag (a model that stops right after the JSON)
when its body parses. The content is the text outside the calls, stripped ("" when nothing is left)."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    """One call. Invariant: `arguments` is a JSON text of an object (the OpenAI shape of arguments)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A finished answer split into calls and the rest. Invariant: every ParsedCall came from a complete
    block; `content` holds every character of the text outside them (stripped at both ends)."""

    calls: tuple[ParsedCall, ...]
    content: str


def _call(body: str, names: Collection[str] | None) -> ParsedCall | None:
    """The call a block's body holds, or None when it is not one (kept as text then)."""
    try:
        item = json.loads(body)
    except ValueError:
        return None
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    if names is not None and item["name"] not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))


def extract_tool_calls(text: str, names: Collection[str] | None = None) -> ExtractedToolCalls:
    """The calls in `text` (see the module docstring); `names`: the offered functions (None: any name)."""
    calls: list[ParsedCall] = []
    kept: list[str] = []
    cursor = search = 0  # text before `cursor` is decided; blocks are looked for from `search`
    while (start := text.find(OPEN, search)) >= 0:
        body = start + len(OPEN)
        close, reopen = text.find(CLOSE, body), text.find(OPEN, body)
        if reopen >= 0 and (close < 0 or reopen < close):  # never closed before the next block: text
            search = reopen
            continue
        end = len(text) if close < 0 else close + len(CLOSE)
        call = _call(text[body:len(text) if close < 0 else close].strip(), names)
        if call is not None:
            kept.append(text[cursor:start])
            calls.append(call)
            cursor = end
        search = end
    kept.append(text[cursor:])
    return ExtractedToolCalls(tuple(calls), "".join(kept).strip())
