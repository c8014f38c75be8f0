"""`--reasoning-parser NAME`: a reasoning model's thinking split off its answer (vLLM's parsers, by name).

Qwen3 (`qwen3`) and DeepSeek-R1 / QwQ (`deepseek_r1`) think in a `<think>...</think>` block before they
answer. The text inside becomes the message's reasoning, the text after it the content (where tool calls are
then read). Whitespace at both ends of the reasoning and at the start of the answer after the block is
dropped (the models write newlines around the tags).

Where the block starts is read from the end of the rendered prompt (ReasoningPlan.for_prompt): a template that
ends the prompt with `<think>` (Qwen3.5, Qwen3 thinking-2507, newer R1 templates) has the output start inside
the block, one that ends it with `</think>` (Qwen3 with `enable_thinking: false`) has it start in the
answer; otherwise the output may open the block itself, as its first text. A `deepseek_r1` output that does
not open one is reasoning anyway until `</think>` (R1 models always think first; `qwen3` ones may not). A
constrained request (a grammar: response_format, structured_outputs, a forced tool call) starts outside the
block: its grammar holds from the first token, so its text is the answer.

Streamed text is read as it grows (ReasoningScanner): each piece is decided once, holding back only what may
still become a tag (or trailing whitespace), so the pieces add up to the parse of the whole text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpilot.server.openai.hermes_tool_parser import OPEN as TOOL_CALL_OPEN


@dataclass(frozen=True)
class ReasoningSyntax:
    """How one family marks its reasoning. Invariants: `open` and `close` are non-empty and differ.
    `implicit_open`: output that does not open a block is reasoning anyway, until `close`.
    `tool_call_ends`: a tool call's marker inside the block ends it (Qwen3.5 may call a tool without
    closing its thinking first)."""

    open: str = "<think>"
    close: str = "</think>"
    implicit_open: bool = False
    tool_call_ends: bool = False


REASONING_PARSERS: dict[str, ReasoningSyntax] = {
    "qwen3": ReasoningSyntax(tool_call_ends=True),
    "deepseek_r1": ReasoningSyntax(implicit_open=True),
}


class Phase(enum.Enum):
    START = "start"  # nothing decided: the output may open a block
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True)
class ReasoningPlan:
    """One request's reading of its output. Invariants: `phase` is where the output starts; `ends` are the
    markers that end the reasoning (the syntax's close first); `implicit_open` as the syntax's, False for a
    constrained request."""

    syntax: ReasoningSyntax
    phase: Phase
    ends: tuple[str, ...]
    implicit_open: bool

    @classmethod
    def for_prompt(cls, syntax: ReasoningSyntax, prompt_tail: str, constrained: bool = False,
                   tool_calls: bool = False) -> ReasoningPlan:
        """The plan for a prompt whose rendered text ends with `prompt_tail`. `tool_calls`: the request's tool
        calls are read out of the answer (a call marker then ends the reasoning where the syntax says so)."""
        tail = prompt_tail.rstrip()
        if tail.endswith(syntax.close):
            phase = Phase.CONTENT
        elif tail.endswith(syntax.open) and not constrained:
            phase = Phase.REASONING
        else:
            phase = Phase.START
        ends = (syntax.close, TOOL_CALL_OPEN) if tool_calls and syntax.tool_call_ends else (syntax.close,)
        return cls(syntax, phase, ends, syntax.implicit_open and not constrained)

    def scanner(self) -> ReasoningScanner:
        """The state of one output read as it grows."""
        return ReasoningScanner(self)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a finished output."""
        piece = ReasoningScanner(self).feed(text, final=True)
        return piece.reasoning, piece.content


@dataclass(frozen=True)
class ReasoningPiece:
    """Text newly decided: what belongs to the reasoning and what to the answer."""

    reasoning: str = ""
    content: str = ""


def _held(text: str, start: int, markers: tuple[str, ...]) -> int:
    """How many trailing characters of text[start:] may be the start of one of `markers`."""
    longest = 0
    for marker in markers:
        for keep in range(min(len(marker) - 1, len(text) - start), longest, -1):
            if text.endswith(marker[:keep]):
                longest = keep
                break
    return longest


class ReasoningScanner:
    """One output's text read as it grows: `feed(text_so_far)` answers the newly decided piece. Invariants:
    `_pos` characters of the text are decided (never moves back); `feed(..., final=True)` decides the rest;
    the pieces of all calls add up to the plan's split of the whole text."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self._plan = plan
        self._phase = plan.phase
        self._lead = True  # at the start of the phase's text: leading whitespace (and a repeated open tag) drop
        self._pos = 0

    @property
    def in_reasoning(self) -> bool:
        return self._phase is Phase.REASONING

    def feed(self, text: str, final: bool = False) -> ReasoningPiece:
        """The piece of `text` (the whole text so far) decided since the last call; `final`: the text is whole."""
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            before = (self._phase, self._pos, self._lead)
            if self._phase is Phase.START:
                self._start(text, final)
            elif self._phase is Phase.REASONING:
                reasoning.append(self._reasoning(text, final))
            else:
                content.append(self._content(text))
            if (self._phase, self._pos, self._lead) == before:
                return ReasoningPiece("".join(reasoning), "".join(content))

    def _start(self, text: str, final: bool) -> None:
        """Whether the output opens a block (its first text is the open tag), once that is known."""
        rest = text[self._pos:]
        first = rest.lstrip()
        opener = self._plan.syntax.open
        if first.startswith(opener):
            self._phase, self._lead = Phase.REASONING, True
            self._pos = len(text) - len(first) + len(opener)
        elif final or (first and not opener.startswith(first)):
            implicit = self._plan.implicit_open
            # an answer without a block keeps its text as written; implicit reasoning drops its lead
            self._phase, self._lead = (Phase.REASONING, True) if implicit else (Phase.CONTENT, False)

    def _skip_lead(self, text: str, final: bool) -> bool:
        """Moves past leading whitespace (and, in the reasoning, an open tag the prompt already wrote); True
        when text follows that is decided to be the phase's own."""
        opener = self._plan.syntax.open
        while True:
            rest = text[self._pos:]
            first = rest.lstrip()
            self._pos = len(text) - len(first)
            if self._phase is Phase.REASONING and first.startswith(opener):
                self._pos += len(opener)
                continue
            if not first or (self._phase is Phase.REASONING and opener.startswith(first) and not final):
                return False
            self._lead = False
            return True

    def _reasoning(self, text: str, final: bool) -> str:
        if self._lead and not self._skip_lead(text, final):
            return ""
        ends = self._plan.ends
        found = [(at, marker) for marker in ends if (at := text.find(marker, self._pos)) >= 0]
        if found:
            at, marker = min(found)
            piece = text[self._pos:at].rstrip()
            # a tool call's marker is the answer's: it stays in the text the tool parser reads
            self._pos = at + len(marker) if marker == self._plan.syntax.close else at
            self._phase, self._lead = Phase.CONTENT, marker == self._plan.syntax.close
            return piece
        end = len(text) if final else len(text) - _held(text, self._pos, ends)
        piece = text[self._pos:end].rstrip()  # trailing whitespace waits: it drops if the block closes after it
        self._pos = len(text) if final else self._pos + len(piece)
        return piece

    def _content(self, text: str) -> str:
        if self._lead and not self._skip_lead(text, True):
            return ""
        piece = text[self._pos:]
        self._pos = len(text)
        return piece
