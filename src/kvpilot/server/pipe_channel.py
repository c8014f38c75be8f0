"""PipeEndpoint: one side of the engine core process's channel, two one-way OS pipes of pickled messages,
built so that neither side can ever block the other.

A pipe holds 64 KiB (1 MiB here when the kernel allows): a sender that wrote into a full pipe used to wait
inside its step loop or event loop until the peer read, and a peer busy writing its own large message back
never would. Now:
- `send` pickles on the caller's thread (the message is the caller's snapshot), refuses a message over
  `max_message_bytes` with MessageTooLargeError, and queues the frame for this endpoint's sender thread:
  the only thread that ever writes the pipe, so a full pipe holds up that thread alone.
- `recv` reads one whole message (blocking: the core's loop between steps, a reader thread); `read_ready`
  reads what is there without blocking (the server's event loop, on a non-blocking descriptor) and keeps a
  partial message in its own buffer until the rest arrives.
- The sender records when it last moved a byte: `stalled_s()` is how long queued bytes have waited on a
  peer that does not read, which the watchdog names in the log and in /health.

Frames are multiprocessing's (a 4-byte big-endian signed length, then the pickle), read and written here.
Invariants: frames go out whole and in the order of `send`; after the peer closed, `recv` raises EOFError
and `send` raises BrokenPipeError; `close` sends what was queued first (bounded by a timeout).
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import queue
import struct
import threading
import time
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


class MessageTooLargeError(ValueError):
    """A message over the channel's size limit: refused before anything of it is written."""


def widen_pipe(fd: int) -> None:
    """Asks for a PIPE_BYTES buffer (fewer sender waits); the kernel's default stays where it refuses."""
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass


class FrameSender:
    """The thread that writes an endpoint's frames. `pending_bytes` counts what is queued and not yet
    written; `last_progress` is when a write last moved bytes (or when the queue turned non-empty)."""

    def __init__(self, fd: int, name: str) -> None:
        self._fd, self.name = fd, name
        self._frames: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.pending_bytes = 0
        self.last_progress = time.monotonic()
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._write_forever, name=f"kvpilot-send-{name}", daemon=True)
        self._thread.start()

    def put(self, frame: bytes) -> None:
        if self.error is not None:
            raise BrokenPipeError(f"the channel {self.name} is closed: {self.error}")
        with self._lock:
            if self.pending_bytes == 0:
                self.last_progress = time.monotonic()
            self.pending_bytes += len(frame)
        self._frames.put(frame)

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds that queued bytes have waited without a byte written; 0.0 when nothing waits."""
        with self._lock:
            if self.pending_bytes == 0 or self.error is not None:
                return 0.0
            return max(0.0, (time.monotonic() if now is None else now) - self.last_progress)

    def close(self, timeout_s: float) -> bool:
        """Stops after what is queued; True when everything queued was written within `timeout_s`."""
        self._frames.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _write_forever(self) -> None:
        while (frame := self._frames.get()) is not None:
            if self.error is not None:
                continue  # the peer is gone: drop what is left, nobody reads it
            try:
                self._write(memoryview(frame))
            except OSError as exc:
                self.error = exc
                with self._lock:
                    self.pending_bytes = 0

    def _write(self, data: memoryview) -> None:
        while data:
            written = os.write(self._fd, data[:WRITE_CHUNK_BYTES])
            data = data[written:]
            with self._lock:
                self.pending_bytes -= written
                self.last_progress = time.monotonic()


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
        """Queues `message` (never waits on the pipe); MessageTooLargeError over the size limit, a pickling
        error for what does not pickle, BrokenPipeError once the peer is gone."""
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
WATCH_EVERY_S = 1.0


class ChannelWatchdog:
    """A daemon thread that logs, once a stall, when an endpoint's sent messages have waited over
    `stall_after_s` on a peer that does not read (and once when they move again). `stalled` is True meanwhile
    (/health answers 503 with it)."""

    def __init__(self, endpoint: Any, stall_after_s: float = STALL_AFTER_S) -> None:
        self._endpoint, self.stall_after_s = endpoint, stall_after_s
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
