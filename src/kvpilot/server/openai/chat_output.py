"""How a chat choice's text becomes its message when it is more than content: reasoning split off first
(`--reasoning-parser`: reasoning_parser.py, or harmony_parser.py for gpt-oss's `openai_gptoss`), then tool
calls read out of the answer (tool_calls.py).

Reasoning is sent under both names vLLM has used: `reasoning` (current vLLM) and `reasoning_content` (older
vLLM, and the clients written for it), null when the model did not reason; the message's content is then the
answer alone (null when there is none). Streamed, the reasoning goes out as `delta.reasoning` /
`delta.reasoning_content` while the model thinks, then the answer as `delta.content`, held back only where a
tool call may begin (ToolCallPlan.streamable); the last chunk carries the rest and the calls. The deltas of a
stream add up to the message of the same text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpilot.server.openai.harmony_parser import HARMONY_REASONING_PARSER, HarmonyPlan
from kvpilot.server.openai.reasoning_parser import REASONING_PARSERS, ReasoningPlan
from kvpilot.server.openai.tool_calls import ToolCallPlan

if TYPE_CHECKING:
    from kvpilot.server.openai.protocol import ChatCompletionRequest

REASONING_FIELDS = ("reasoning", "reasoning_content")


def _with_reasoning(fields: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
    return {**fields, **{name: reasoning for name in REASONING_FIELDS}}


@dataclass(frozen=True)
class ChatOutput:
    """One chat request's reading of its output. Invariant: at least one of `tools` and `reasoning` is set
    (a request with neither has no ChatOutput: its text is its content)."""

    tools: ToolCallPlan | None = None
    reasoning: ReasoningPlan | HarmonyPlan | None = None

    @property
    def harmony(self) -> bool:
        """The output is read as harmony messages: its markers must reach the text (skip_special_tokens off)."""
        return isinstance(self.reasoning, HarmonyPlan)

    def split(self, text: str) -> tuple[str | None, str]:
        """(the reasoning, None without a parser or when empty; the answer's text) of a finished output."""
        if self.reasoning is None:
            return None, text
        reasoning, content = self.reasoning.split(text)
        return reasoning or None, content

    def shape_message(self, choice: dict[str, Any], text: str, finish_reason: str | None) -> dict[str, Any]:
        """A non-streaming chat choice: reasoning, content and tool calls in its message."""
        reasoning, content = self.split(text)
        if self.reasoning is not None:
            message = _with_reasoning(choice["message"], reasoning)
            message["content"] = content if content or reasoning is None else None
            choice = {**choice, "message": message}
        return self.tools.shape_message(choice, content, finish_reason) if self.tools else choice

    def stream(self) -> ChoiceStream:
        """The state of one streamed choice."""
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice's text, read as it grows. Invariants: `_answer` is the answer's text decided so
    far (the reasoning split off); `_streamed` of its characters went out as content, never more than the
    tool plan lets stream; the reasoning went out as soon as it was decided."""

    def __init__(self, output: ChatOutput) -> None:
        self._output = output
        self._scanner = output.reasoning.scanner() if output.reasoning is not None else None
        self._answer = ""
        self._streamed = 0

    def _advance(self, text: str, final: bool) -> str:
        """Reads `text` (the whole text so far); returns the reasoning decided since the last call."""
        if self._scanner is None:
            self._answer = text
            return ""
        piece = self._scanner.feed(text, final)
        self._answer += piece.content
        return piece.reasoning

    def running(self, text: str) -> dict[str, Any] | None:
        """The delta of a running chunk for `text`, or None when nothing new may go out yet."""
        reasoning = self._advance(text, final=False)
        tools = self._output.tools
        ready = tools.streamable(self._answer, self._streamed) if tools else len(self._answer)
        delta: dict[str, Any] = _with_reasoning({}, reasoning) if reasoning else {}
        if ready > self._streamed:
            delta["content"] = self._answer[self._streamed:ready]
            self._streamed = ready
        return delta or None

    def final(self, choice: dict[str, Any], text: str, finish_reason: str | None) -> dict[str, Any]:
        """The last chunk's choice (`choice`: its plain shape): the rest of the reasoning and of the answer,
        and the tool calls."""
        reasoning = self._advance(text, final=True)
        tools = self._output.tools
        if tools is not None:
            choice = tools.final_delta(choice, self._answer, finish_reason, self._streamed)
        else:
            held = self._answer[self._streamed:]
            choice = {**choice, "delta": {"content": held} if held else {}}
        self._streamed = len(self._answer)
        if not reasoning:
            return choice
        return {**choice, "delta": _with_reasoning({}, reasoning) | choice["delta"]}


def chat_output_for(body: ChatCompletionRequest, reasoning_parser: str | None, prompt_tail: str) -> ChatOutput | None:
    """The reading of a chat request's output (None: its text is its content). `reasoning_parser`: the
    server's --reasoning-parser; `prompt_tail`: the end of the rendered prompt (where a block may open). The
    `openai` tool parser reads the harmony reading's answer, so it brings that reading with it."""
    tools = body.tool_call_plan()
    harmony_calls = tools is not None and tools.parser == "openai"
    if reasoning_parser == HARMONY_REASONING_PARSER or harmony_calls:
        return ChatOutput(tools, HarmonyPlan.for_prompt(prompt_tail, tool_calls=harmony_calls))
    if reasoning_parser is None:
        return ChatOutput(tools) if tools is not None else None
    constrained = body.structured_outputs_constraint() is not None
    plan = ReasoningPlan.for_prompt(REASONING_PARSERS[reasoning_parser], prompt_tail, constrained,
                                    tool_calls=tools is not None and tools.parser is not None)
    return ChatOutput(tools, plan)
