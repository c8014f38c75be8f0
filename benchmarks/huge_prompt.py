"""A huge prompt blocks nobody: /health and another client's stream while a ~10 MB prompt is tokenized.

Starts `kvpilot serve` (`python -m kvpilot.server`, its own process) on the embedded model, starts one small
streaming request, then sends a ~10 MB text prompt to /v1/completions (or a ~10 MB JSON list of token ids,
or a ~10 MB chat message) while a thread polls GET /health every 20 ms. The huge prompt is far longer than
max_model_len, so the answer must be a clean 400 (`context_length_exceeded`) after tokenization.

    .venv/bin/python benchmarks/huge_prompt.py                     # 10 MB text prompt, /v1/completions
    .venv/bin/python benchmarks/huge_prompt.py --kind chat         # the same text as one chat message
    .venv/bin/python benchmarks/huge_prompt.py --kind ids          # ~10 MB of token ids (JSON parsing)

Prints the /health latency (max, p99, p50) over the window in which the huge request was in flight, and
whether the small stream kept getting tokens (chunks and the longest gap between them in that window).
Target: /health max < 100 ms.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

import httpx

from server_process import start_server as start_process

MODEL = "bench"
SENTENCE = "The quick brown fox jumps over the lazy dog; 12345 lorem ipsum dolor sit amet. "


def huge_body(kind: str, size_bytes: int) -> bytes:
    """A request body of about size_bytes (the prompt itself: text, chat message, or token ids)."""
    text = (SENTENCE * (size_bytes // len(SENTENCE) + 1))[:size_bytes]
    if kind == "chat":
        body: dict = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    elif kind == "ids":
        body = {"prompt": [1000 + i % 7000 for i in range(size_bytes // 5)], "max_tokens": 4}
    else:
        body = {"prompt": text, "max_tokens": 4}
    return json.dumps({"model": MODEL, **body}).encode()


@dataclass
class Poller:
    """Polls GET /health every interval_s in its own thread; records (start, latency, status)."""

    url: str
    interval_s: float
    samples: list[tuple[float, float, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                status = client.get("/health").status_code
                self.samples.append((start, time.monotonic() - start, status))
                self.stop.wait(max(0.0, self.interval_s - (time.monotonic() - start)))


@dataclass
class Streamer:
    """One small streaming completion; records the arrival time of every SSE chunk."""

    url: str
    max_tokens: int
    chunk_times: list[float] = field(default_factory=list)
    first: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Tell me a long story about a fox.", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.url, timeout=600) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.chunk_times.append(time.monotonic())
                        self.first.set()
                    if self.stop.is_set():
                        break
        self.first.set()


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    return start_process([
        "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--kv-cache-memory", args.kv_cache_memory,
        "--served-model-name", MODEL])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(kind: str, size: int, response: httpx.Response, window: tuple[float, float], poller: Poller,
           streamer: Streamer) -> None:
    start, end = window
    overlapping = [(lat, s) for t, lat, s in poller.samples if t <= end and t + lat >= start]
    health = [lat for lat, _ in overlapping]
    statuses = {s for _, s in overlapping}
    chunks = [t for t in streamer.chunk_times if start <= t <= end]
    before = [t for t in streamer.chunk_times if t < start]
    rate_before = (len(before) - 1) / (before[-1] - before[0]) if len(before) > 1 else float("nan")
    edges = [start, *chunks, end]
    gap = max(b - a for a, b in zip(edges, edges[1:]))
    error = response.json().get("error", {}) if response.headers.get("content-type", "").startswith(
        "application/json") else {}
    print(f"huge request: {kind}, body {size / 1e6:.1f} MB -> HTTP {response.status_code} "
          f"code={error.get('code')!r} in {end - start:.2f} s; message: {str(error.get('message'))[:110]}")
    print(f"/health during it: {len(health)} polls, statuses {sorted(statuses)}, max {max(health) * 1e3:.1f} ms, "
          f"p99 {percentile(health, 0.99) * 1e3:.1f} ms, p50 {percentile(health, 0.5) * 1e3:.1f} ms "
          f"(target max < 100 ms)")
    print(f"small stream: {rate_before:.1f} chunks/s before; during it {len(chunks)} chunks "
          f"({len(chunks) / (end - start):.1f}/s), longest gap without a chunk {gap * 1e3:.0f} ms "
          f"-> {'kept getting tokens' if chunks and gap < 1.0 else 'STALLED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=("text", "chat", "ids"), default="text")
    parser.add_argument("--size-mb", type=float, default=10.0)
    parser.add_argument("--poll-ms", type=float, default=20.0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    args = parser.parse_args()
    body = huge_body(args.kind, int(args.size_mb * 1e6))  # encoded before the clock starts
    process, url = start_server(args)
    poller = Poller(url, args.poll_ms / 1000.0)
    streamer = Streamer(url, max_tokens=args.max_model_len - 64)
    threads = [threading.Thread(target=poller.run, daemon=True), threading.Thread(target=streamer.run, daemon=True)]
    try:
        for thread in threads:
            thread.start()
        streamer.first.wait(120)
        time.sleep(2.0)  # undisturbed polls and chunks first: the stream's own rate
        path = "/v1/chat/completions" if args.kind == "chat" else "/v1/completions"
        with httpx.Client(base_url=url, timeout=600) as client:
            start = time.monotonic()
            response = client.post(path, content=body, headers={"Content-Type": "application/json"})
            end = time.monotonic()
        time.sleep(0.5)  # polls stuck behind the huge request complete (and are recorded) after it
        poller.stop.set()
        threads[0].join(60)
        report(args.kind, len(body), response, (start, end), poller, streamer)
    finally:
        poller.stop.set()
        streamer.stop.set()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


if __name__ == "__main__":
    main()
