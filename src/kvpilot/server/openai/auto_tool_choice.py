"""Whether chat tool_choice "auto" (the default when a request sends tools) is served, and by which parser.

The flags decide when given (vLLM's names): `--enable-auto-tool-choice --tool-call-parser NAME` or
`--tool-call-parser NAME` alone turn it on with that parser, `--no-enable-auto-tool-choice` turns it off.
Without them the model's chat template decides, once, as the engine turns ready:

* a template that renders no tools: kvpilot lists them itself in the system prompt, asking for Hermes
  `<tool_call>` blocks (tool_prompt.py), so the hermes parser reads the answer: on, hermes;
* a template that renders tools and names a parser's call marker (`<tool_call>` in Qwen, Hermes and SmolLM3
  templates): on, with that parser;
* a template that renders tools in another format (Llama 3's JSON, Mistral's [TOOL_CALLS], ...): off, since
  no parser kvpilot has would read its calls; "auto" is then a 400 naming the flags.

The decision is logged at start-up with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.server.openai.tool_parsers import TOOL_CALL_MARKERS
from kvpilot.server.openai.tool_prompt import tool_support


@dataclass(frozen=True)
class AutoToolChoice:
    """The decision: `parser` is a key of tool_parsers.TOOL_CALL_PARSERS (served) or None (a 400); `reason`
    says why, for the start-up log."""

    parser: str | None
    reason: str

    def log_line(self) -> str:
        if self.parser is None:
            return f'tool_choice "auto" is off: {self.reason}'
        return f'tool_choice "auto" is on (tool calls read by the {self.parser} parser): {self.reason}'


def decide_auto_tool_choice(enable: bool | None, parser: str | None, tokenizer: Any) -> AutoToolChoice:
    """The decision for the server's flags (`enable`: --enable-auto-tool-choice, None when not given;
    `parser`: --tool-call-parser) and the served model's tokenizer (None: a model without one)."""
    if enable is False:
        return AutoToolChoice(None, "--no-enable-auto-tool-choice")
    if parser is not None:
        return AutoToolChoice(parser, f"--tool-call-parser {parser}")
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not template:
        return AutoToolChoice(None, "the model has no chat template")
    if not tool_support(tokenizer).tools:
        return AutoToolChoice("hermes", "the chat template renders no tools, so kvpilot lists them in the system "
                                        "prompt as Hermes <tool_call> instructions; --no-enable-auto-tool-choice "
                                        "turns it off")
    for name, marker in TOOL_CALL_MARKERS.items():
        if marker in template:
            return AutoToolChoice(name, f"the chat template asks for {marker} calls; --no-enable-auto-tool-choice "
                                        "turns it off")
    return AutoToolChoice(None, "the chat template renders tools in a format no tool-call parser of kvpilot reads; "
                                "start with --enable-auto-tool-choice --tool-call-parser NAME if one does")
