"""Issue 14: `kvpilot chat` driven without a terminal, on the real embedded model. A real SIGINT mid-reply stops
that reply only (the request is aborted, its KV blocks freed, the next turn answers); a reply cut at the token
limit says so; Ctrl-C at the prompt keeps the session; prompt_toolkit gives line editing and Up-arrow history;
the command prints no INFO log line unless -v."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from kvpilot.chat_session import BANNER, ChatSession, TerminalLines, run_chat
from kvpilot.llm import LLM
from kvpilot.sampling_params import SamplingParams
from tests.server.tiny_server import write_tiny_config

QUESTION = "What is the capital of France?"
GREEDY = SamplingParams(temperature=0, max_tokens=48)


@pytest.fixture(scope="module")
def llm(llm_fp32) -> LLM:
    """An engine of its own (its KV blocks are checked) on the session's float32 weights: no second load."""
    return LLM(loaded=llm_fp32.loaded, kv_cache_memory="256MiB", max_model_len=1024)


class Script:
    """A LineSource: each item is a line, or an exception class raised at that read (EOFError at the end)."""

    def __init__(self, *items: str | type[BaseException]) -> None:
        self.items = list(items)

    def read(self, prompt: str) -> str:
        if not self.items:
            raise EOFError
        item = self.items.pop(0)
        if isinstance(item, str):
            return item
        raise item()


class SigintAfter(io.StringIO):
    """Output that sends this process a real SIGINT (Ctrl-C) once `writes` reply pieces have been written."""

    def __init__(self, writes: int) -> None:
        super().__init__()
        self.left = writes

    def write(self, text: str) -> int:
        self.left -= 1
        if self.left == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(text)


def _idle(llm: LLM) -> bool:
    scheduler = llm.engine.scheduler
    return (not llm.engine.has_unfinished_requests() and scheduler.num_running == 0 and scheduler.num_waiting == 0
            and scheduler.kv.usage == 0.0)


def test_scripted_conversation_answers_greedily(llm: LLM) -> None:
    out = io.StringIO()
    run_chat(llm, GREEDY, None, Script(QUESTION, "/exit", "never read"), out)
    assert out.getvalue().startswith(BANNER) and "Paris" in out.getvalue()


def test_ctrl_c_mid_reply_stops_that_reply_only(llm: LLM) -> None:
    long_reply = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN when run as a background job (&)
    out = SigintAfter(writes=4)
    session = ChatSession(llm, long_reply, None, out)
    stopped = session.reply("Tell me a long story about a dragon.")
    assert stopped is not None and stopped.stopped and stopped.finish_reason is None
    assert 0 < stopped.num_tokens < 200  # cut well before the limit
    assert out.getvalue().endswith("\n(reply stopped; it and its question are left out of the history)\n")
    assert session.history == []  # the next prompt starts on a fresh line, the cut exchange forgotten
    assert _idle(llm)  # the request was aborted and its blocks freed
    assert signal.getsignal(signal.SIGINT) is before  # restored: Ctrl-C at the prompt works again
    session.handle("/reset")
    session.params = GREEDY
    answer = session.reply(QUESTION)
    assert answer is not None and not answer.stopped and "Paris" in answer.text
    assert [m["role"] for m in session.history] == ["user", "assistant"]


class SigintDuringStep:
    """The real LLM, with a real SIGINT sent while the engine computes the step after `num_outputs` outputs: as
    when the user presses Ctrl-C between two tokens (closing the stream still aborts the real request)."""

    def __init__(self, llm: LLM, num_outputs: int) -> None:
        self.llm, self.tokenizer, self.num_outputs = llm, llm.tokenizer, num_outputs

    def stream(self, prompt_ids, params):  # type: ignore[no-untyped-def]
        inner = self.llm.stream(prompt_ids, params)
        try:
            for i, output in enumerate(inner):
                if i == self.num_outputs:
                    os.kill(os.getpid(), signal.SIGINT)
                yield output
        finally:
            inner.close()


def test_ctrl_c_between_tokens_prints_nothing_more_and_forgets_the_exchange(llm: LLM) -> None:
    long_reply = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    out = io.StringIO()
    session = ChatSession(llm, GREEDY, "You are terse.", out)
    assert session.reply(QUESTION) is not None and len(session.history) == 3
    kept, shown_before = list(session.history), out.getvalue()
    session.llm, session.params = SigintDuringStep(llm, num_outputs=3), long_reply
    stopped = session.reply("Tell me a long story about a dragon.")
    assert stopped is not None and stopped.stopped and stopped.num_tokens == 3  # the 4th token is not shown
    shown = out.getvalue()[len(shown_before):]
    assert shown == stopped.text + "\n(reply stopped; it and its question are left out of the history)\n"
    assert session.history == kept  # system, the first question and its answer
    assert _idle(llm)


def test_a_reply_cut_at_the_limit_says_so_and_the_next_turn_works(llm: LLM) -> None:
    out = io.StringIO()
    session = ChatSession(llm, SamplingParams(temperature=0, max_tokens=3), None, out)
    cut = session.reply(QUESTION)
    assert cut is not None and cut.finish_reason == "length" and cut.num_tokens == 3
    assert "(reply cut at the token limit, 3 tokens: --max-tokens raises it)" in out.getvalue()
    session.params = GREEDY
    session.handle("/reset")
    assert "Paris" in session.reply(QUESTION).text  # type: ignore[union-attr]
    finished = session.reply("Thanks!")
    assert finished is not None and finished.finish_reason == "stop"
    assert out.getvalue().count("token limit") == 1


def test_ctrl_c_at_the_prompt_keeps_the_session(llm: LLM) -> None:
    out = io.StringIO()
    run_chat(llm, GREEDY, "You are terse.", Script(KeyboardInterrupt, QUESTION), out)
    text = out.getvalue()
    assert "(Ctrl-D or /exit quits)" in text and "Paris" in text and text.endswith("\n")


class Keys(TerminalLines):
    """prompt_toolkit reading keystrokes from a pipe: each read() first types the next scripted keys."""

    def __init__(self, pipe, *keys: str) -> None:  # type: ignore[no-untyped-def]
        super().__init__(input=pipe, output=DummyOutput())
        self.pipe, self.keys = pipe, list(keys)

    def read(self, prompt: str) -> str:
        self.pipe.send_text(self.keys.pop(0))
        return super().read(prompt)


@pytest.fixture()
def pipe() -> Iterator[object]:
    with create_pipe_input() as created:
        yield created


def test_terminal_input_edits_lines_and_recalls_history(pipe) -> None:  # type: ignore[no-untyped-def]
    keys = Keys(pipe, "What is the capital of Frnce?\x1b[D\x1b[D\x1b[D\x1b[Da\r",  # Left x4, insert the missing "a"
                "\x1b[A\r", "half a line\x03", "\x04")  # Up recalls it; Ctrl-C; Ctrl-D
    assert keys.read("> ") == QUESTION
    assert keys.read("> ") == QUESTION
    with pytest.raises(KeyboardInterrupt):
        keys.read("> ")
    with pytest.raises(EOFError):
        keys.read("> ")


@pytest.mark.slow
def test_chat_command_logs_with_verbose(tmp_path: Path) -> None:
    """-v shows the INFO log lines. Without -v there are none: tests/api/test_cli.py's chat on the real model
    (test_chat_keeps_history_and_streams_replies) answers Paris with no INFO line, so that run is not repeated."""
    chat = [sys.executable, "-m", "kvpilot.cli", "chat", "--temperature", "0", "--max-tokens", "16", "--dtype",
            "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "1024"]
    # -v needs no answer, only the log lines: a tiny dummy model loads in a fraction of the real one's time
    tiny = ["--model", str(write_tiny_config(tmp_path, narrow=True)), "--load-format", "dummy"]
    verbose = subprocess.run([*chat, *tiny, "-v"], input="", capture_output=True, text=True, timeout=300)
    assert verbose.returncode == 0 and "INFO" in verbose.stderr
