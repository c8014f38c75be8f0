"""One offline engine in a child process, driven by JSON lines: `gpu_peers.py` keeps each engine loaded in its
own process (their CUDA contexts, allocators and compile caches apart) and alternates passes between them.

Child side: `serve(engine)` answers `{"cmd": "run", "requests": [[prompt_ids, max_tokens], ...],
"temperature": t}` with the tokens made, the seconds the engine's generate call took (measured in the child, so
the pipe is not timed) and how many requests got fewer tokens than asked; `{"cmd": "check", "prompt": ids,
"num_tokens": n}` with greedy token ids; `{"cmd": "exit"}` ends it. Replies are stdout lines starting with
REPLY_PREFIX; anything else an engine prints is passed on to the parent's log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

REPLY_PREFIX = "@@engine-child "

Request = tuple[list[int], int]  # (prompt token ids, tokens to generate)


class ChildEngine(Protocol):
    def generate(self, requests: list[Request], temperature: float) -> list[int]:
        """Runs all requests together (ignoring EOS); returns each one's number of output tokens."""

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        """The first `num_tokens` greedy token ids after `prompt`."""


@dataclass(frozen=True)
class RunReply:
    num_tokens: int
    seconds: float
    num_short: int  # requests that produced fewer tokens than asked

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds


def _reply(document: dict) -> None:
    sys.stdout.write(REPLY_PREFIX + json.dumps(document) + "\n")
    sys.stdout.flush()


def serve(engine: ChildEngine) -> None:
    """The child's loop: announces it is ready, then answers commands from stdin until exit or EOF."""
    _reply({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "exit":
            break
        if command["cmd"] == "run":
            requests = [(list(p), int(n)) for p, n in command["requests"]]
            start = time.perf_counter()
            lengths = engine.generate(requests, float(command["temperature"]))
            seconds = time.perf_counter() - start
            _reply({"num_tokens": sum(lengths), "seconds": seconds,
                    "num_short": sum(made < asked for made, (_, asked) in zip(lengths, requests))})
        elif command["cmd"] == "check":
            _reply({"token_ids": engine.greedy(list(command["prompt"]), int(command["num_tokens"]))})
        else:
            raise ValueError(f"unknown command {command['cmd']!r}")


class ChildProcess:
    """Parent side: starts `argv`, waits for its ready line, then asks and answers one command at a time.
    The child's stderr and its non-reply stdout go to `log_path`."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.label, self.log_path = label, log_path
        self._log: IO[str] = log_path.open("w")
        self._process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                         text=True, env=env)
        self._read_reply()

    def run(self, requests: list[Request], temperature: float) -> RunReply:
        reply = self._ask({"cmd": "run", "requests": requests, "temperature": temperature})
        return RunReply(reply["num_tokens"], reply["seconds"], reply["num_short"])

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        return self._ask({"cmd": "check", "prompt": prompt, "num_tokens": num_tokens})["token_ids"]

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._process.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self._process.stdin.close()
                self._process.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        self._log.close()

    def _ask(self, command: dict) -> dict:
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        return self._read_reply()

    def _read_reply(self) -> dict:
        for line in self._process.stdout:
            if line.startswith(REPLY_PREFIX):
                return json.loads(line[len(REPLY_PREFIX):])
            self._log.write(line)
            self._log.flush()
        self._process.wait()
        raise RuntimeError(f"{self.label} exited ({self._process.returncode}) without answering; see "
                           f"{self.log_path}")
