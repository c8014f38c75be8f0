"""Tools, tool calls and tool results in the prompt, whatever the model's chat template knows of them.

The template always gets them as transformers passes them: `tools`, assistant messages' `tool_calls`, `tool`
messages. Where the template would drop one of the three (it renders nothing of it, or raises on it),
kvpilot writes it into the messages instead, so nothing a client sent silently vanishes:

* tools: a "# Tools" section in the system prompt (appended to a leading system message, else a system
  message of its own in front), each tool's JSON, and how to call one: a Hermes `<tool_call>` block, the
  format `--tool-call-parser hermes` reads back (hermes_tool_parser.py);
* an assistant turn's tool_calls: appended to its content as those same `<tool_call>` blocks;
* tool results: a user message, each result in `<tool_response>` tags, in the order sent (consecutive
  results share one message, so user and assistant turns keep alternating).

What a template renders is found once per template by probes (ToolSupport.probe): a marker placed in a
tool's name, in a call and in a result must come out in the rendered text. Comparing the text itself with
and without tools would be fooled by templates that print the date or reorder; a marker is not.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from kvpilot.server.openai.hermes_tool_parser import CLOSE, OPEN

_TOOL_MARK = "kvpilot_probe_tool_5e2d"
_CALL_MARK = "kvpilot_probe_call_5e2d"
_RESULT_MARK = "kvpilot_probe_result_5e2d"
_PROBE_TOOLS = [{"type": "function", "function": {"name": _TOOL_MARK, "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}]
_PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_probe", "type": "function", "function": {"name": _CALL_MARK, "arguments": {"q": _CALL_MARK}}}]}
_PROBE_RESULT = {"role": "tool", "tool_call_id": "call_probe", "name": _CALL_MARK, "content": _RESULT_MARK}
_PROBE_ASK = {"role": "user", "content": "probe"}


@dataclass(frozen=True)
class ToolSupport:
    """Which of tools, assistant tool_calls and tool results a chat template renders (True) or drops."""

    tools: bool
    tool_calls: bool
    tool_results: bool

    @classmethod
    def probe(cls, tokenizer: Any) -> ToolSupport:
        def shows(mark: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> bool:
            try:
                return mark in _render(tokenizer, messages, tools, True)
            except Exception:  # noqa: BLE001 - a template that raises on it does not render it
                return False

        return cls(tools=shows(_TOOL_MARK, [_PROBE_ASK], _PROBE_TOOLS),
                   tool_calls=shows(_CALL_MARK, [_PROBE_ASK, _PROBE_CALL]),
                   tool_results=shows(_RESULT_MARK, [_PROBE_ASK, _PROBE_CALL, _PROBE_RESULT]))


_SUPPORT: dict[str | None, ToolSupport] = {}
_SUPPORT_LOCK = threading.Lock()


def tool_support(tokenizer: Any) -> ToolSupport:
    """The probe's answer for this tokenizer's template (probed once per template text)."""
    template = getattr(tokenizer, "chat_template", None)
    with _SUPPORT_LOCK:
        known = _SUPPORT.get(template)
    if known is None:
        known = ToolSupport.probe(tokenizer)
        with _SUPPORT_LOCK:
            _SUPPORT[template] = known
    return known


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The system-prompt section that lists the tools for a template that does not."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call one or more of these functions to answer. Each is given as JSON, its "
            f"arguments as a JSON schema:\n{listed}\n\nTo call a function, write one line per call, a JSON object "
            f'between {OPEN} and {CLOSE}:\n{OPEN}{{"name": "<function name>", "arguments": {{<its arguments>}}}}'
            f"{CLOSE}")


def call_block(call: dict[str, Any]) -> str:
    """One call of an assistant turn as the Hermes text a model writes for it."""
    function = call.get("function", {})
    arguments = function.get("arguments", {})
    arguments_json = json.dumps(arguments, ensure_ascii=False) if not isinstance(arguments, str) else arguments
    name = json.dumps(function.get("name"), ensure_ascii=False)
    return f'{OPEN}{{"name": {name}, "arguments": {arguments_json}}}{CLOSE}'


def adapt_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   support: ToolSupport) -> list[dict[str, Any]]:
    """`messages` with what the template would drop written into them (see the module docstring); the
    input is not changed."""
    adapted: list[dict[str, Any]] = []
    results_at: int | None = None  # where the user message holding the tool results just seen is
    for message in messages:
        if message.get("tool_calls") and not support.tool_calls:
            blocks = "\n".join(call_block(call) for call in message["tool_calls"])
            content = f"{message['content']}\n{blocks}" if message["content"] else blocks
            message = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
        if message["role"] == "tool" and not support.tool_results:
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if results_at is None:
                results_at = len(adapted)
                adapted.append({"role": "user", "content": response})
            else:
                adapted[results_at]["content"] += "\n" + response
            continue
        results_at = None
        adapted.append(dict(message))
    if tools and not support.tools:
        section = tools_section(tools)
        if adapted and adapted[0]["role"] == "system":
            first = adapted[0]["content"]
            adapted[0] = {**adapted[0], "content": f"{first}\n\n{section}" if first else section}
        else:
            adapted.insert(0, {"role": "system", "content": section})
    return adapted


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None) -> str:
    kwargs = dict(template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(messages, add_generation_prompt, **kwargs)


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a chat (transformers-shaped messages and tools), nothing of the tools dropped.
    A chat without tools, tool calls or tool results renders exactly as the template alone renders it.
    `template_kwargs`: more template variables (a request's chat_template_kwargs)."""
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return _render(tokenizer, messages, None, add_generation_prompt, template_kwargs)
    adapted = adapt_messages(messages, tools, tool_support(tokenizer))
    return _render(tokenizer, adapted, tools or None, add_generation_prompt, template_kwargs)
