"""The interactive loop behind `kvpilot chat`: keeps the conversation and streams each reply."""

from __future__ import annotations

import sys
from typing import TextIO

from kvpilot.sampling_params import SamplingParams


def run_chat(llm, params: SamplingParams, system: str | None, stdin: TextIO = sys.stdin,
             stdout: TextIO = sys.stdout) -> None:
    """Reads user lines until EOF or /exit; each reply is generated over the whole history."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    interactive = stdin.isatty()
    stdout.write("kvpilot chat: type a message; /reset clears the history, /exit or Ctrl-D quits.\n")
    while True:
        if interactive:
            stdout.write("\n> ")
            stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            history = history[:1] if system else []
            stdout.write("(history cleared)\n")
            continue
        history.append({"role": "user", "content": text})
        reply = []
        for output in llm.stream(llm.tokenizer.encode_chat(history), params):
            reply.append(output.delta_text)
            stdout.write(output.delta_text)
            stdout.flush()
        stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
