"""HeldTokenizer: wraps serving.tokenize_request to record the thread of every call and to hold chosen prompts
in their worker until the test releases them (so tests order events without sleeping or timing)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import kvpilot.server.serving as serving


class HeldTokenizer:
    """Install with `monkeypatch.setattr(serving, "tokenize_request", HeldTokenizer(...))`. `held` is set when a
    prompt that `hold(body)` picks starts tokenizing; it then waits for `release`."""

    def __init__(self, hold: Callable[[Any], bool]) -> None:
        self.real = serving.tokenize_request
        self.hold = hold
        self.threads: list[threading.Thread] = []
        self.held = threading.Event()
        self.release = threading.Event()

    def __call__(self, body: Any, *args: Any) -> Any:
        self.threads.append(threading.current_thread())
        if self.hold(body):
            self.held.set()
            if not self.release.wait(120):
                raise TimeoutError("the test never released the held prompt")
        return self.real(body, *args)
