"""`--reasoning-parser openai_gptoss`: gpt-oss's harmony output read into reasoning, answer and tool calls.

gpt-oss writes its reply as harmony messages, each `<|start|>assistant HEADER<|message|>BODY` ended by
`<|end|>` (more messages follow), `<|call|>` (a tool call: the turn ends) or `<|return|>` (the turn ends);
the chat template writes the first message's `<|start|>assistant` into the prompt. The header names the
channel (`<|channel|>analysis`, `commentary` or `final`), may name a recipient (`to=functions.NAME`, after
the role or after the channel) and the body's type (`<|constrain|>json`, or a bare `json`). A message is:

* reasoning: the `analysis` channel, or a recipient that is not one of the offered functions' namespace
  (a built-in tool of the model: its use is part of the thinking);
* a tool call: a recipient `functions.NAME` when the request's tool calls are read (tool_choice "auto" with
  `--tool-call-parser openai`): it goes into the answer in one form, `<|start|>assistant to=functions.NAME
  <|message|>ARGUMENTS<|call|>`, which harmony_tool_parser.py reads; without a tool parser its body is text;
* the answer: `final`, a `commentary` without recipient (a preamble before calls), or no channel.

Messages are joined by a newline: the reasoning's, and the answer's (a call's text included). An output that does not start as a harmony header (a
constrained request's JSON, a model that ignores the format) is all answer, as written. The markers are
special tokens, which detokenizing drops by default: a request read this way is detokenized with
`skip_special_tokens` false (serving.py), and no marker reaches the reasoning or the content other than
the call form above (which the tool parser consumes).

Streamed text is read as it grows (HarmonyScanner, the same `feed` contract as reasoning_parser.py's
scanner): each piece is decided once, holding back only what may still become a marker, so the pieces add
up to the reading of the whole text.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from kvpilot.server.openai.reasoning_parser import ReasoningPiece

HARMONY_REASONING_PARSER = "openai_gptoss"
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
BODY_ENDS = (END, CALL, RETURN, START)  # a message without its end marker ends where the next one starts
FUNCTIONS = "functions."
CALL_OPEN = f"{START}assistant to="
"""What starts a call in the answer (the tool parser's marker: text before it may stream as content). gpt-oss's
chat template writes past calls so too, which is how the template names the parser (auto_tool_choice.py)."""
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


class Kind(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"


@dataclass(frozen=True)
class Header:
    """One message's header as written. `channel`, `recipient`: None when not named."""

    channel: str | None
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
        return cls(channel.group(1) if channel else None, recipient.group(1) if recipient else None)

    def kind(self, tool_calls: bool) -> Kind:
        """What the body is; `tool_calls`: the request's calls are read (else a call's body is answer text)."""
        if self.recipient is not None and not self.recipient.startswith(FUNCTIONS):
            return Kind.REASONING
        if self.recipient is not None:
            return Kind.CALL if tool_calls else Kind.CONTENT
        return Kind.REASONING if self.channel == "analysis" else Kind.CONTENT


@dataclass(frozen=True)
class HarmonyPlan:
    """One request's reading of its harmony output. Invariants: `header` is the start of the first message's
    header the prompt already wrote (e.g. "assistant"), or None when the prompt ended inside a message's body
    (`body_header` is then that message's header); `tool_calls`: calls go into the answer in the call form."""

    header: str | None
    body_header: Header | None
    tool_calls: bool

    @classmethod
    def for_prompt(cls, prompt_tail: str, tool_calls: bool = False) -> HarmonyPlan:
        """The plan for a prompt whose rendered text ends with `prompt_tail` (its last message's start)."""
        at = prompt_tail.rfind(START)
        if at < 0:
            return cls("", None, tool_calls)
        last = prompt_tail[at + len(START):]
        opened = last.find(MESSAGE)
        if opened >= 0 and not any(end in last[opened:] for end in BODY_ENDS):
            return cls(None, Header.parse(last[:opened]), tool_calls)
        if opened >= 0:  # the prompt's last message is closed: the output starts a new one
            return cls("", None, tool_calls)
        return cls(last, None, tool_calls)

    def scanner(self) -> HarmonyScanner:
        return HarmonyScanner(self)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of a finished output."""
        piece = HarmonyScanner(self).feed(text, final=True)
        return piece.reasoning, piece.content


def _held(text: str, start: int) -> int:
    """How many trailing characters of text[start:] may be the start of a marker."""
    for keep in range(min(max(map(len, MARKERS)) - 1, len(text) - start), 0, -1):
        if any(marker.startswith(text[-keep:]) for marker in MARKERS):
            return keep
    return 0


def strip_markers(text: str) -> str:
    """`text` without stray markers (a malformed message must not show them to the user)."""
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text


class HarmonyScanner:
    """One output's text read as it grows: `feed(text_so_far)` answers the newly decided piece. Invariants:
    `_pos` characters of the text are decided (never moves back); `_kind` is None while a header is read (from
    `_header_at`, after the plan's `_prefix`); the pieces of all calls add up to the plan's split."""

    def __init__(self, plan: HarmonyPlan) -> None:
        self._plan = plan
        self._pos = self._header_at = 0
        self._prefix = plan.header or ""
        self._first = plan.header is not None  # the first header may turn out not to be one (plain output)
        self._kind: Kind | None = None
        self._lead = ""  # what goes out before the message's first text: a newline, or a call's form
        self._wrote: set[bool] = set()  # reasoning (True) / answer (False) has text: the next message's starts a line
        if plan.body_header is not None:
            self._open(plan.body_header)

    def feed(self, text: str, final: bool = False) -> ReasoningPiece:
        """The piece of `text` (the whole text so far) decided since the last call; `final`: the text is whole."""
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            before = (self._pos, self._kind)
            if self._kind is None:
                self._header(text, final)
            else:
                kind = self._kind
                (reasoning if kind is Kind.REASONING else content).append(self._body(text, final, kind))
            if (self._pos, self._kind) == before:
                if final and self._kind is Kind.CALL:  # a call cut short (max_tokens) still closes its form
                    content.append(self._lead + CALL)
                    self._kind, self._lead = None, ""
                return ReasoningPiece("".join(reasoning), "".join(content))

    def _open(self, header: Header) -> None:
        kind = self._kind = header.kind(self._plan.tool_calls)
        if kind is Kind.CALL:  # its form delimits it; the answer's text after it starts a line of its own
            self._lead = f"{START}assistant to={header.recipient}{MESSAGE}"
        else:
            self._lead = "\n" if (kind is Kind.REASONING) in self._wrote else ""

    def _header(self, text: str, final: bool) -> None:
        """Reads a header up to `<|message|>`; decides plain output on a first one that cannot be a header."""
        if self._first:
            rest = text[self._header_at:]
            if not rest or (not final and any(m.startswith(rest) for m in ("<|", " to="))):
                return
            self._first = False
            if not rest.startswith(("<|", " to=")):  # not harmony: the whole output is the answer, as written
                self._kind = Kind.CONTENT
                return
        at = text.find(MESSAGE, self._header_at)
        if at < 0:
            return
        self._open(Header.parse(self._prefix + text[self._header_at:at]))
        self._prefix = ""
        self._pos = at + len(MESSAGE)

    def _body(self, text: str, final: bool, kind: Kind) -> str:
        """The message's text decided so far (with its lead once there is text: a call's form at once)."""
        found = [at for end in BODY_ENDS if (at := text.find(end, self._pos)) >= 0]
        end = min(found) if found else (len(text) if final else len(text) - _held(text, self._pos))
        piece = strip_markers(text[self._pos:end])
        self._pos = end
        if found:  # the message ended: the next header starts at its end marker (kept when it is <|start|>)
            marker = next(m for m in BODY_ENDS if text.startswith(m, end))
            self._pos = self._header_at = end + (0 if marker == START else len(marker))
            self._kind = None
        if piece or kind is Kind.CALL:
            piece, self._lead = self._lead + piece, ""
            self._wrote.add(kind is Kind.REASONING)
        return piece + (CALL if found and kind is Kind.CALL else "")


def has_harmony_markers(tokenizer: object) -> bool:
    """Whether `tokenizer` (kvpilot's Tokenizer, or None) has harmony's markers as tokens: a gpt-oss model."""
    backend = getattr(tokenizer, "backend", None)
    to_id = getattr(backend, "token_to_id", None)
    return to_id is not None and all(to_id(marker) is not None for marker in (CHANNEL, MESSAGE, CALL))


def harmony_start_note(reasoning_parser: str | None, tool_call_parser: str | None) -> str | None:
    """The start-up line for a gpt-oss model served with --reasoning-parser `reasoning_parser` and tool_choice
    "auto" read by `tool_call_parser` (None: "auto" is off); None: nothing to say."""
    notes = []
    if reasoning_parser is None:
        notes.append(f"its analysis channel is sent as reasoning_content (--reasoning-parser "
                     f"{HARMONY_REASONING_PARSER}, on by default for harmony models as in vLLM)")
    elif reasoning_parser != HARMONY_REASONING_PARSER:
        notes.append(f"--reasoning-parser {reasoning_parser} does not read harmony messages: leave it out (or use "
                     f"{HARMONY_REASONING_PARSER}) so that raw channels do not reach the content")
    if tool_call_parser != "openai":
        notes.append("its tool calls are read by --tool-call-parser openai (vLLM's flags: --enable-auto-tool-choice "
                     "--tool-call-parser openai)")
    return "the model writes gpt-oss's harmony format: " + "; ".join(notes) if notes else None
