"""The benchmarks' leanest streaming client: `concurrency` keep-alive connections driven by one epoll loop, each
sending token-id prompts to /v1/completions one after another and counting SSE content chunks in the raw bytes
as they arrive (nothing parsed but the status line and the last chunk's usage).

Why so spare: on a small box the client shares the server's cores, and what it spends shows up as server
slowdown. Each wake-up of the client also preempts one of the engine's threads mid-step, stalling the other at
its next barrier, so the loop sleeps out `min_poll_interval_s` between polls: a server writes a step's chunks
to every stream at once, and the client reads them all in one or two wake-ups a step instead of one a chunk.
That delays seeing a finished stream, and so the next request, by at most the interval: it can only
understate the server. Measured with 64 streams of a 1-layer dummy model on a 2-core EPYC family 26
(2026-11-28, CPU per 32,768 chunks): aiohttp 0.95-1.0 s, an asyncio Protocol 0.65 s, the same polled every
2 ms 0.4 s, this loop 0.3 s (docs/benchmark-log.md).
"""

from __future__ import annotations

import json
import re
import select
import socket
import time
from collections import deque
from urllib.parse import urlsplit

_CONTENT = b'"choices":[{'  # in every content chunk; the usage chunk's choices are empty
_END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked body (SSE data never holds a raw CR or LF)
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_TAIL_BYTES = 16384  # kept of each response, for its status line and its usage chunk near the end
_RECV_BYTES = 1 << 16


class ChunkCounter:
    """One response's bytes as they arrive. A pattern split between two reads is counted once: the bytes
    carried over are shorter than the pattern."""

    def __init__(self) -> None:
        self.head = b""
        self.tail = bytearray()  # the response's last _TAIL_BYTES to 2 x _TAIL_BYTES bytes
        self.carry = b""
        self.num_chunks = 0

    def feed(self, data: bytes) -> bool:
        """True once the response is complete (its chunked body ended)."""
        if len(self.head) < 16:
            self.head += data[:16]
        scanned = self.carry + data
        self.num_chunks += scanned.count(_CONTENT)
        self.carry = scanned[-(len(_CONTENT) - 1):]
        # appended in place and trimmed now and then: a fresh tail sliced every read copied up to 32 KiB a chunk
        # (user CPU a 32,768-chunk run 0.15-0.17 -> 0.11-0.15 s, dummy model, c64)
        self.tail += data
        if len(self.tail) > 2 * _TAIL_BYTES:
            del self.tail[:-_TAIL_BYTES]
        return self.tail.endswith(_END)

    def result(self) -> tuple[int, int]:
        """(completion tokens from the usage chunk, content chunks); RuntimeError on a status other than 200."""
        if not self.head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"server answered {self.head!r}: {self.tail[-400:]!r}")
        usage = self.tail.rfind(b'"usage":{')
        match = _COMPLETION_TOKENS.search(self.tail, usage) if usage >= 0 else None
        return int(match.group(1)) if match else 0, self.num_chunks


def request_body(prompt: list[int], output_len: int) -> dict:
    """The benchmarks' streamed completion: greedy, exactly `output_len` tokens, usage in the last chunk."""
    return {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def request_bytes(host: str, prompt: list[int], output_len: int) -> bytes:
    body = json.dumps(request_body(prompt, output_len)).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def wire_run(url: str, prompts: list[list[int]], output_len: int, concurrency: int,
             min_poll_interval_s: float) -> tuple[float, int, int, float]:
    """Streams every prompt, `concurrency` at a time (a connection takes the next prompt when its response
    ends); (wall seconds, completion tokens, content chunks, this process's CPU seconds)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "localhost", parts.port or 80
    pending = deque(prompts)
    poller = select.epoll()
    conns: dict[int, tuple[socket.socket, ChunkCounter]] = {}
    num_tokens = num_chunks = 0
    start, cpu_start = time.perf_counter(), time.process_time()

    def send_next(sock: socket.socket) -> None:
        sock.sendall(request_bytes(f"{host}:{port}", pending.popleft(), output_len))
        conns[sock.fileno()] = (sock, ChunkCounter())

    try:
        for _ in range(min(concurrency, len(pending))):
            sock = socket.create_connection((host, port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            poller.register(sock.fileno(), select.EPOLLIN)
            send_next(sock)
        while conns:
            polled = time.monotonic()
            for fd, _ in poller.poll():
                sock, counter = conns[fd]
                data = sock.recv(_RECV_BYTES)
                if not data:
                    raise ConnectionError("the server closed a connection mid-response")
                if not counter.feed(data):
                    continue
                tokens, chunks = counter.result()
                num_tokens, num_chunks = num_tokens + tokens, num_chunks + chunks
                del conns[fd]
                if pending:
                    send_next(sock)
                else:
                    poller.unregister(fd)
                    sock.close()
            rest = min_poll_interval_s - (time.monotonic() - polled)
            if rest > 0:
                time.sleep(rest)
    finally:
        for sock, _ in conns.values():
            sock.close()
        poller.close()
    return time.perf_counter() - start, num_tokens, num_chunks, time.process_time() - cpu_start
