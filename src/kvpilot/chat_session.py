"""The interactive loop behind `kvpilot chat`: keeps the conversation and streams each reply.

Input comes from a LineSource: prompt_toolkit on a terminal (line editing, Up/Down history), plain lines
otherwise (a pipe or a file). Ctrl-C while a reply streams stops that reply only: SIGINT sets a flag that is
checked between engine steps, so an engine step is never cut in half, and the request is aborted (its KV
blocks freed) before the next prompt. Ctrl-C at the prompt clears the line; Ctrl-D or /exit ends the session.

A stopped reply leaves the history with its question: Ctrl-C usually means the answer went the wrong way, and a
half answer kept as the model's own turn would steer every later reply (the user asks again, or rephrases).

Invariants: the prompt always starts on a fresh line; no text is printed after Ctrl-C (a token the engine
finishes meanwhile is dropped); `history` alternates user / assistant turns after the optional system message,
and holds only replies that ended on their own (a reply cut at the token limit is kept as far as it got, and
followed by a notice naming the flag that raises it).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, TextIO

from kvpilot.sampling_params import SamplingParams

BANNER = "kvpilot chat: type a message; /reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops a reply.\n"
PROMPT = "> "


class LineSource(Protocol):
    """Where user lines come from. read() raises EOFError at the end of input (Ctrl-D) and KeyboardInterrupt
    when the user presses Ctrl-C at the prompt."""

    def read(self, prompt: str) -> str: ...


class StreamLines:
    """Lines from a file or pipe (no prompt is shown: the input is not typed)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def read(self, prompt: str) -> str:
        line = self.stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")


class TerminalLines:
    """prompt_toolkit on a terminal: Emacs-style line editing, Up/Down through this session's lines.
    `input`/`output` are for tests (prompt_toolkit's pipe input and DummyOutput)."""

    def __init__(self, input=None, output=None) -> None:  # type: ignore[no-untyped-def]
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory

        self.session = PromptSession(history=InMemoryHistory(), input=input, output=output)

    def read(self, prompt: str) -> str:
        return self.session.prompt(prompt)


def default_line_source(stdin: TextIO = sys.stdin) -> LineSource:
    return TerminalLines() if stdin.isatty() else StreamLines(stdin)


@dataclass(frozen=True)
class Reply:
    """One assistant turn as streamed: `stopped` by Ctrl-C, else finish_reason is the engine's."""

    text: str
    num_tokens: int
    finish_reason: str | None
    stopped: bool


@contextmanager
def sigint_sets(flag: threading.Event) -> Iterator[None]:
    """While inside, SIGINT (Ctrl-C) sets `flag` instead of raising KeyboardInterrupt. Only the main thread
    can take signals: elsewhere this does nothing (and Ctrl-C is not delivered there anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class ChatSession:
    """A conversation with `llm`, written to `out`. `stop_requested` is the Ctrl-C flag: set it (from a signal
    handler or a test) and the reply streaming now stops after the current engine step."""

    def __init__(self, llm, params: SamplingParams, system: str | None, out: TextIO = sys.stdout) -> None:  # type: ignore[no-untyped-def]
        self.llm, self.params, self.system, self.out = llm, params, system, out
        self.history: list[dict[str, str]] = self._fresh_history()
        self.stop_requested = threading.Event()

    def _fresh_history(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def handle(self, line: str) -> bool:
        """One user line: a command or a message. Returns False when the session should end."""
        text = line.strip()
        if text == "/exit":
            return False
        if text == "/reset":
            self.history = self._fresh_history()
            self._say("(history cleared)")
        elif text:
            self.reply(text)
        return True

    def reply(self, text: str) -> Reply | None:
        """Streams the assistant's answer to `text` over the whole history; None if the prompt was refused."""
        try:
            prompt_ids = self.llm.tokenizer.encode_chat([*self.history, {"role": "user", "content": text}])
            stream = self.llm.stream(prompt_ids, self.params)
            reply = self._stream(stream)
        except ValueError as exc:  # e.g. the conversation no longer fits max_model_len
            self._say(f"error: {exc}\n(/reset clears the history)")
            return None
        if reply.stopped:
            self._say("(reply stopped; it and its question are left out of the history)")
            return reply
        self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply.text}]
        if reply.finish_reason == "length":
            self._say(f"(reply cut at the token limit, {reply.num_tokens} tokens: --max-tokens raises it)")
        return reply

    def _stream(self, stream) -> Reply:  # type: ignore[no-untyped-def]
        self.stop_requested.clear()
        parts: list[str] = []
        num_tokens, finish_reason, stopped = 0, None, False
        with sigint_sets(self.stop_requested):
            try:
                for output in stream:
                    if self.stop_requested.is_set() and not output.finished:
                        stopped = True  # Ctrl-C came during this step: its token is not shown
                        break
                    completion = output.outputs[0]
                    parts.append(output.delta_text)
                    self.out.write(output.delta_text)
                    self.out.flush()
                    num_tokens, finish_reason = len(completion.token_ids), completion.finish_reason
                    if self.stop_requested.is_set() and not output.finished:
                        stopped = True  # Ctrl-C came while writing: no need to wait for another step
                        break
            finally:
                stream.close()  # aborts the request if it is still running
        self.out.write("\n")
        return Reply("".join(parts), num_tokens, None if stopped else finish_reason, stopped)

    def _say(self, notice: str) -> None:
        self.out.write(notice + "\n")
        self.out.flush()


def run_chat(llm, params: SamplingParams, system: str | None, lines: LineSource | None = None,  # type: ignore[no-untyped-def]
             out: TextIO = sys.stdout) -> None:
    """Reads user lines until Ctrl-D, end of input or /exit; each reply is generated over the whole history."""
    session = ChatSession(llm, params, system, out)
    source = lines if lines is not None else default_line_source()
    out.write(BANNER)
    while True:
        try:
            line = source.read(PROMPT)
        except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line, as a shell does
            out.write("(Ctrl-D or /exit quits)\n")
            continue
        except EOFError:
            out.write("\n")
            return
        if not session.handle(line):
            return
