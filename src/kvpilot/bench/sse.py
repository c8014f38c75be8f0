"""Incremental Server-Sent Events parsing (only the ``data:`` field matters for OpenAI streams)."""

from __future__ import annotations


class SseParser:
    """Feed raw bytes as they arrive; get back the complete events' data payloads.

    An event ends at a blank line; several ``data:`` lines in one event join with newlines (SSE
    spec). Comment lines (``:``) and other fields are ignored. Handles \\n, \\r\\n and \\r endings.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk.decode("utf-8", errors="replace")
        self._buffer = self._buffer.replace("\r\n", "\n").replace("\r", "\n")
        events: list[str] = []
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events

    def flush(self) -> list[str]:
        """Events left when the stream ended without a final blank line."""
        events = self.feed(b"\n\n") if (self._buffer or self._data) else []
        return events
