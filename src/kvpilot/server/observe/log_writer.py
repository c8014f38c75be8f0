"""This process's stdout and stderr written by a thread of their own, so that no log line, print or traceback
ever blocks the event loop or the engine core's step loop.

A server whose stderr or stdout is a pipe that nobody reads (a supervisor or test harness holding the pipe
without reading it, a terminal paused with Ctrl-S) blocks in write() once the pipe's 64 KiB are full. Every
logging call then froze the thread that made it, in both processes, which share the descriptor: the event loop
and the step loop stopped for good, and /health never answered again. Here `sys.stdout` and `sys.stderr`
become QueuedStreams, and every logging handler that wrote to the old objects (uvicorn's included) is pointed
at them: a write queues its text (bounded, never waiting) and one writer thread writes it out, in order. While
the output is blocked the queue fills, further writes are dropped and counted, and the count is written once
the output moves again.

What C code writes to descriptors 1 and 2 directly is not covered (nothing on the serving path does).
Invariants: text reaches each stream in the order written; a write never blocks on the output; at most
MAX_QUEUED_CHARS wait; `drain` (at exit) waits at most DRAIN_TIMEOUT_S.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import queue
import signal
import sys
import threading
import time
from typing import IO, Any

MAX_QUEUED_CHARS = 8 * 1024 * 1024
DRAIN_TIMEOUT_S = 2.0


class StreamWriter:
    """The writer thread and its queue of (stream, text), bounded by the characters it holds."""

    def __init__(self, max_chars: int = MAX_QUEUED_CHARS) -> None:
        self._queue: queue.SimpleQueue[tuple[IO[str], str]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.max_chars = max_chars
        self.num_queued_chars = 0
        self.num_dropped = 0  # writes refused since the last report
        threading.Thread(target=self._write_forever, name="kvpilot-output-writer", daemon=True).start()

    def put(self, stream: IO[str], text: str) -> None:
        with self._lock:
            if self.num_queued_chars + len(text) > self.max_chars:
                self.num_dropped += 1
                return
            self.num_queued_chars += len(text)
        self._queue.put((stream, text))

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Waits until everything queued was written; False if the output stayed blocked that long."""
        deadline = time.monotonic() + timeout_s
        while self.num_queued_chars:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def _write_forever(self) -> None:
        while True:
            stream, text = self._queue.get()
            with self._lock:
                num_dropped, self.num_dropped = self.num_dropped, 0
            try:
                if num_dropped:
                    stream.write(f"[kvpilot: {num_dropped} writes to this output were dropped: it was not being "
                                 "read (its pipe was full)]\n")
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):  # closed or broken: nothing to do but go on dropping
                pass
            finally:
                with self._lock:
                    self.num_queued_chars -= len(text)


class QueuedStream:
    """A text stream whose writes the StreamWriter carries out; anything else is the original stream's."""

    def __init__(self, original: IO[str], writer: StreamWriter) -> None:
        self.original, self._writer = original, writer

    def write(self, text: str) -> int:
        if text:
            self._writer.put(self.original, text)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass  # the writer flushes after every write; a caller must not wait on the output

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding...
        return getattr(self.original, name)


_writer: StreamWriter | None = None


def detach_output() -> StreamWriter:
    """Makes sys.stdout and sys.stderr QueuedStreams and points every StreamHandler that wrote to the old ones
    at them (idempotent). Call it after the logging set-up (uvicorn's included) of a serving process."""
    global _writer
    if _writer is None:
        _writer = StreamWriter()
        atexit.register(_writer.drain)
    replaced: dict[int, QueuedStream] = {}
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, QueuedStream):
            replaced[id(stream)] = QueuedStream(stream, _writer)
            setattr(sys, name, replaced[id(stream)])
    loggers = [logging.getLogger()] + [logger for logger in logging.root.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    for handler in {h for logger in loggers for h in logger.handlers}:
        if isinstance(handler, logging.StreamHandler) and id(handler.stream) in replaced:
            with handler.lock or threading.Lock():  # setStream would flush the old stream: it may block
                handler.stream = replaced[id(handler.stream)]
    return _writer


def stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` makes this process print every thread's Python stack to its stderr: where a start that
    never turns ready, or a step that never ends, is stuck. Written by the signal handler straight to the
    original descriptor 2 (not queued: it must work while the writer thread itself is stuck)."""
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
