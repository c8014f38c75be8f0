"""`--tool-call-parser openai`: gpt-oss's harmony tool calls read out of its answer.

The harmony reading (harmony_parser.py) puts each message to a recipient `functions.NAME` into the answer as
`<|start|>assistant to=functions.NAME<|message|>ARGUMENTS<|call|>`, whichever header variant the model wrote
(recipient after the role or after the channel, `<|constrain|>json` or a bare `json`); a message written in
that shape by the model itself is read the same way (channel and constraint markers may stand before
`<|message|>`). A block becomes a call when NAME is one of the offered functions (when they are given) and
its body is a JSON object, or empty (`{}`); otherwise its body stays in the content, without markers. The
content is the text outside the calls, stripped ("" when nothing is left)."""

from __future__ import annotations

import json
import re
from collections.abc import Collection

from kvpilot.server.openai.harmony_parser import BODY_ENDS, CALL_OPEN, FUNCTIONS, MESSAGE, START, strip_markers
from kvpilot.server.openai.hermes_tool_parser import ExtractedToolCalls, ParsedCall

_BLOCK = re.compile(re.escape(CALL_OPEN + FUNCTIONS) + r"([^\s<]+)[^<]*(?:<\|(?:channel|constrain)\|>[^<]*)*"
                    + re.escape(MESSAGE))


def _call(name: str, body: str, names: Collection[str] | None) -> ParsedCall | None:
    """The call a block holds, or None when it is not one (its body is then kept as text)."""
    if names is not None and name not in names:
        return None
    try:
        arguments = json.loads(body) if body.strip() else {}
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def extract_tool_calls(text: str, names: Collection[str] | None = None) -> ExtractedToolCalls:
    """The calls in `text` (see the module docstring); `names`: the offered functions (None: any name)."""
    calls: list[ParsedCall] = []
    kept: list[str] = []
    cursor = 0  # text before `cursor` is decided
    for block in _BLOCK.finditer(text):
        if block.start() < cursor:  # inside the previous block's body (a body never holds a header)
            continue
        ends = [(at, end) for end in BODY_ENDS if (at := text.find(end, block.end())) >= 0]
        at, end = min(ends) if ends else (len(text), "")
        body = text[block.end():at]
        call = _call(block.group(1), body, names)
        kept.append(text[cursor:block.start()])
        if call is None:
            kept.append(body)
        else:
            calls.append(call)
        cursor = at if end == START else at + len(end)
    kept.append(text[cursor:])
    return ExtractedToolCalls(tuple(calls), strip_markers("".join(kept)).strip())
