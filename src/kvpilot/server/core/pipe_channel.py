"""PipeEndpoint: one side of the engine core process's channel, two one-way OS pipes of pickled messages,
built so that no send ever waits for the other side to read.

A pipe holds 64 KiB (1 MiB here where the kernel allows). Before, the core's step loop waited in write()
whenever its pipe was full (an event loop that is slow to read held up every stream's next step), and the
server's event loop read a large message whole, waiting for its last byte. Now:
- `send` pickles on the caller's thread (the message is the caller's snapshot), refuses a message over
  `max_message_bytes` with MessageTooLargeError, writes what the pipe takes without waiting (a non-blocking
  descriptor: the usual small message costs one write, as before) and queues the rest for this endpoint's
  sender thread, which writes it as the pipe drains.
- `recv` reads one whole message (blocking: the core's loop between steps, a reader thread); `read_ready`
  reads what is there without blocking (the server's event loop) and keeps a partial message in its own
  buffer until the rest arrives.
- The sender records when bytes last moved: `stalled_s()` is how long queued bytes have waited on a peer
  that does not read, which the watchdog names in the log and in /health.

Frames are multiprocessing's (a 4-byte big-endian signed length, then the pickle), read and written here.
Invariants: frames go out whole and in the order of `send`; after the peer closed, `recv` raises EOFError
and `send` raises BrokenPipeError; `close` sends what was queued first (bounded by a timeout).
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import select
import struct
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger("kvpilot.server")
_HEADER = struct.Struct("!i")
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a 32 MB prompt's text and token ids pickle to ~80 MB
PIPE_BYTES = 1024 * 1024  # Linux's default /proc/sys/fs/pipe-max-size
WRITE_CHUNK_BYTES = 1024 * 1024
CLOSE_TIMEOUT_S = 10.0
MAX_READ_BYTES = 16 * 1024 * 1024  # a read_ready call returns to the loop after this much; it is called again
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
WATCH_EVERY_S = 1.0


class MessageTooLargeError(ValueError):
    """A message over the channel's size limit: refused before anything of it is written."""


def widen_pipe(fd: int) -> None:
    """Asks for a PIPE_BYTES buffer (fewer sender waits); the kernel's default stays where it refuses."""
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass


class FrameSender:
    """Writes an endpoint's frames, in order, without ever waiting on the pipe in the caller's thread.

    `put` writes at once, in the caller's thread, what the pipe takes without waiting when nothing is queued
    (the usual case: a step's result costs one write, no thread hand-over); the rest is queued, and the
    sender thread writes it as the pipe drains. `pending_bytes` counts what is queued and not yet written;
    `last_progress` is when bytes last moved (or when the queue turned non-empty)."""

    def __init__(self, fd: int, name: str) -> None:
        self._fd, self.name = fd, name
        os.set_blocking(fd, False)
        self._frames: deque[memoryview] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self.pending_bytes = 0
        self.last_progress = time.monotonic()
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._write_forever, name=f"kvpilot-send-{name}", daemon=True)
        self._thread.start()

    def put(self, frame: bytes) -> None:
        with self._cond:
            if self.error is not None:
                raise BrokenPipeError(f"the channel {self.name} is closed: {self.error}")
            view = memoryview(frame)
            if not self._frames:
                view = view[self._write_some(view):]
                if not view:
                    return
                self.last_progress = time.monotonic()
            self._frames.append(view)
            self.pending_bytes += len(view)
            self._cond.notify()

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds that queued bytes have waited without a byte written; 0.0 when nothing waits."""
        with self._cond:
            if self.pending_bytes == 0 or self.error is not None:
                return 0.0
            return max(0.0, (time.monotonic() if now is None else now) - self.last_progress)

    def close(self, timeout_s: float) -> bool:
        """Stops after what is queued; True when everything queued was written within `timeout_s`."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _write_some(self, view: memoryview) -> int:
        """Bytes of `view` the pipe took without waiting (under the lock); OSError marks the channel broken."""
        try:
            return os.write(self._fd, view[:WRITE_CHUNK_BYTES])
        except BlockingIOError:
            return 0
        except OSError as exc:
            self.error = exc
            self._frames.clear()
            self.pending_bytes = 0
            raise BrokenPipeError(f"the channel {self.name} is closed: {exc}") from exc

    def _write_forever(self) -> None:
        while True:
            with self._cond:
                while not self._frames and not self._closing:
                    self._cond.wait()
                if not self._frames:
                    return
            select.select([], [self._fd], [], WATCH_EVERY_S)  # room in the pipe (or look again)
            with self._cond:
                if self._frames:
                    self._write_head()

    def _write_head(self) -> None:
        view = self._frames[0]
        try:
            written = self._write_some(view)
        except BrokenPipeError:
            return  # the peer is gone: its reader, or the next put, reports it
        if written:
            self.pending_bytes -= written
            self.last_progress = time.monotonic()
            if written == len(view):
                self._frames.popleft()
            else:
                self._frames[0] = view[written:]


def _read_exactly(fd: int, size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = os.read(fd, min(left, WRITE_CHUNK_BYTES))
        if not chunk:
            raise EOFError("the other side closed the channel")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class PipeEndpoint:
    """One side of the core process's channel: `reader` gets what the other side's `writer` sends. `name`
    says where this side's messages go ("to the engine core"), for logs and /health."""

    def __init__(self, reader: Connection, writer: Connection, name: str,
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.reader, self.writer, self.name = reader, writer, name
        self.max_message_bytes = max_message_bytes
        widen_pipe(writer.fileno())
        self._sender = FrameSender(writer.fileno(), name)
        self._buffer = bytearray()  # read_ready's partial frame
        self._nonblocking = False

    def send(self, message: Any) -> None:
        """Sends `message`: what the pipe takes now, the rest by the sender thread (never waits on the pipe).
        MessageTooLargeError over the size limit, a pickling error for what does not pickle, BrokenPipeError
        once the peer is gone."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) > self.max_message_bytes:
            raise MessageTooLargeError(
                f"a {type(message).__name__} of {len(payload) / 2**20:.1f} MiB is over the "
                f"{self.max_message_bytes / 2**20:.1f} MiB limit of the channel {self.name}")
        self._sender.put(_HEADER.pack(len(payload)) + payload)

    def recv(self) -> Any:
        """One whole message, waiting for it (a blocking descriptor)."""
        (size,) = _HEADER.unpack(_read_exactly(self.reader.fileno(), _HEADER.size))
        return pickle.loads(_read_exactly(self.reader.fileno(), size))

    def read_ready(self, max_bytes: int | None = MAX_READ_BYTES) -> tuple[list[Any], bool]:
        """Every whole message readable now, without waiting (the descriptor is made non-blocking), and
        True once the peer closed its side (after the messages before the end). Reads at most `max_bytes`
        (None: until the pipe is empty), so that a peer writing fast cannot keep the caller here."""
        fd = self.reader.fileno()
        if not self._nonblocking:
            os.set_blocking(fd, False)
            self._nonblocking = True
        eof, num_read = False, 0
        while max_bytes is None or num_read < max_bytes:
            try:
                chunk = os.read(fd, PIPE_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            self._buffer += chunk
            num_read += len(chunk)
        return self._take_frames(), eof

    def _take_frames(self) -> list[Any]:
        messages, start, buffer = [], 0, self._buffer
        while len(buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + size
            if end > len(buffer):
                break
            messages.append(pickle.loads(buffer[start + _HEADER.size:end]))
            start = end
        del buffer[:start]
        return messages

    def fileno(self) -> int | None:
        return self.reader.fileno()

    def poll(self) -> bool:
        return self.reader.poll()

    def stalled_s(self) -> float:
        """How long this side's queued messages have waited on a peer that does not read (0.0: none)."""
        return self._sender.stalled_s()

    def close(self) -> None:
        """Writes what is queued (up to CLOSE_TIMEOUT_S: a peer that never reads cannot hold the exit), then
        closes both pipes."""
        if not self._sender.close(CLOSE_TIMEOUT_S):
            logger.warning("the channel %s: %d bytes not written after %.0f s, dropped", self.name,
                           self._sender.pending_bytes, CLOSE_TIMEOUT_S)
        self.writer.close()
        self.reader.close()


STALL_AFTER_S = 30.0  # far over a normal step (a core reads between steps), short of a liveness probe's patience


class ChannelWatchdog:
    """A daemon thread that logs, once a stall, when an endpoint's sent messages have waited over
    `stall_after_s` on a peer that does not read (and once when they move again). `stalled` is True meanwhile
    (/health answers 503 with it)."""

    def __init__(self, endpoint: Any, stall_after_s: float | None = None) -> None:
        """`stall_after_s`: None is STALL_AFTER_S as it is when the watchdog starts."""
        self._endpoint = endpoint
        self.stall_after_s = STALL_AFTER_S if stall_after_s is None else stall_after_s
        self.stalled = False
        self._stop = threading.Event()
        name = getattr(endpoint, "name", "channel")
        threading.Thread(target=self._watch, name=f"kvpilot-watch-{name}", daemon=True).start()

    def describe(self) -> str:
        """What /health and the log say of a stall."""
        return (f"the channel {self._endpoint.name} has not moved for {self._endpoint.stalled_s():.0f} s: the "
                "other process does not read its messages (blocked, or in a step this long)")

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S):
            stalled = self._endpoint.stalled_s() > self.stall_after_s
            if stalled and not self.stalled:
                logger.error("%s", self.describe())
            elif self.stalled and not stalled:
                logger.warning("the channel %s moves again", self._endpoint.name)
            self.stalled = stalled
