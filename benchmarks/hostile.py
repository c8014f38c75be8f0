"""The hostile probe of issue 43, as one command: every case gets a 4xx or works, and nobody else notices.

Starts `kvpilot serve` (its own process, the embedded model) with its stdout and stderr held as pipes that
nothing reads (a server used to wedge for good once they filled), a victim client that streams greedy
64-token completions back to back, and a thread that polls GET /health every 20 ms. Then runs each case
alone and prints one row per case: the HTTP statuses it got, how long it took, the victim's inter-token
gaps while it ran (median / p99 / max, against the victim alone before the first case) and /health's
slowest answer in that window.

    .venv/bin/python benchmarks/hostile.py                 # every case (~3 minutes on 2 cores)
    .venv/bin/python benchmarks/hostile.py --only grammar  # the cases whose name contains "grammar"
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from huge_prompt import Poller, percentile
from server_process import start_server as start_process

MODEL = "bench"
TIMEOUT_S = 120.0


@dataclass
class Victim:
    """Streams greedy 64-token completions back to back; records the gap before every chunk after a
    stream's first, as (arrival time, gap)."""

    url: str
    gaps_at: list[tuple[float, float]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Tell me a story about a fox.", "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.url, timeout=TIMEOUT_S) as client:
            while not self.stop.is_set():
                try:
                    self._stream(client, body)
                except httpx.HTTPError:  # the server was killed at the end
                    return

    def _stream(self, client: httpx.Client, body: dict) -> None:
        last = None
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    if last is not None:
                        self.gaps_at.append((now, now - last))
                    last = now

    def gaps(self, start: float, end: float) -> list[float]:
        return [gap for at, gap in self.gaps_at if start <= at <= end]


@dataclass(frozen=True)
class Outcome:
    statuses: str
    detail: str


def _post(client: httpx.Client, path: str, body: object) -> httpx.Response:
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def _completion(**extra: object) -> dict:
    return {"model": MODEL, "prompt": "Answer:", "max_tokens": 16, "temperature": 0, **extra}


def _statuses(responses: list[httpx.Response]) -> Outcome:
    codes = " ".join(str(r.status_code) for r in responses)
    errors = [r.json().get("error", {}) for r in responses if r.status_code >= 400 and r.headers.get(
        "content-type", "").startswith("application/json")]
    detail = "; ".join(f"{e.get('code') or e.get('type')}: {str(e.get('message'))[:70]}" for e in errors[:1])
    return Outcome(codes, detail)


def case_wedge_sequence(client: httpx.Client) -> Outcome:
    """The sequence that wedged the server: a bad regex, a plain completion, 10,000 choices (149 KB)."""
    return _statuses([_post(httpx.Client(base_url=client.base_url, timeout=TIMEOUT_S), "/v1/completions", body)
                      for body in (_completion(guided_regex="(a{1000}){1000}"), _completion(),
                                   _completion(guided_choice=[f"choice number {i}" for i in range(10_000)]))])


GRAMMARS: dict[str, dict] = {
    "grammar: regex (a{1000}){1000}": {"guided_regex": "(a{1000}){1000}"},
    "grammar: nested counted repeats": {"guided_regex": "((a{50}){50}){50}"},
    "grammar: 1 MB regex": {"guided_regex": "(" + "|".join(f"w{i:06d}" for i in range(140_000)) + ")"},
    "grammar: Lark, 3,000 alternatives": {"guided_grammar": "start: " + " | ".join(
        f'"alt{i}"' for i in range(3000))},
    "grammar: 10,000 choices": {"guided_choice": [f"choice number {i}" for i in range(10_000)]},
    "grammar: JSON schema, $ref loop": {"guided_json": {"$ref": "#/$defs/a", "$defs": {
        "a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}},
    "grammar: string minLength 1e9": {"guided_json": {"type": "string", "minLength": 1_000_000_000}},
    "grammar: regex (a+)+$": {"guided_regex": "(a+)+$"},
    "grammar: array minItems 1e6": {"guided_json": {"type": "array", "items": {"type": "integer"},
                                                     "minItems": 1_000_000}},
}


def _grammar_case(extra: dict) -> Callable[[httpx.Client], Outcome]:
    return lambda client: _statuses([_post(client, "/v1/completions", _completion(**extra))])


def case_keepalive(client: httpx.Client) -> Outcome:
    """A non-streamed request on a kept-alive connection against a fresh connection's (Nagle + delayed ACK)."""
    def timed(c: httpx.Client) -> float:
        start = time.monotonic()
        c.get("/health").raise_for_status()
        return time.monotonic() - start
    kept = [timed(client) for _ in range(30)]
    fresh = []
    for _ in range(30):
        with httpx.Client(base_url=client.base_url, timeout=TIMEOUT_S) as once:
            fresh.append(timed(once))
    diff_ms = (statistics.median(kept) - statistics.median(fresh)) * 1e3
    return Outcome("200 x60", f"kept-alive median {statistics.median(kept) * 1e3:.2f} ms, fresh "
                              f"{statistics.median(fresh) * 1e3:.2f} ms ({diff_ms:+.2f} ms)")


def case_chunked_body(client: httpx.Client) -> Outcome:
    """40 MB sent chunked (no Content-Length): the 413 must arrive, not a connection reset."""
    def body():  # noqa: ANN202
        yield b'{"model": "bench", "prompt": "'
        for _ in range(40):
            yield b"x" * 1_000_000
        yield b'"}'
    try:
        response = client.post("/v1/completions", content=body(), headers={"Content-Type": "application/json"})
    except httpx.TransportError as exc:
        return Outcome("reset", f"{type(exc).__name__}: {exc}"[:80])
    return _statuses([response])


def _counts(client: httpx.Client) -> tuple[float, float]:
    text = client.get("/metrics").text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}_count{{[^}}]*}} (\S+)$", text, re.M))
    return total("vllm:time_to_first_token_seconds"), total("vllm:e2e_request_latency_seconds")


def case_abort_before_first_token(client: httpx.Client) -> Outcome:
    """A stream dropped before its first token: the TTFT and E2E histograms count what the docs say."""
    ttft0, e2e0 = _counts(client)
    body = _completion(prompt="word " * 1500, max_tokens=8, stream=True)
    with httpx.Client(base_url=client.base_url, timeout=TIMEOUT_S) as once:
        with once.stream("POST", "/v1/completions", json=body):
            pass  # closed at once, before any token
    time.sleep(2.0)
    ttft1, e2e1 = _counts(client)
    # The victim's requests finish meanwhile and count in both: the difference is the aborted request's.
    return Outcome("-", f"E2E count +{e2e1 - e2e0:.0f}, TTFT count +{ttft1 - ttft0:.0f}: the aborted request "
                        f"counted {'in E2E only' if (e2e1 - e2e0) - (ttft1 - ttft0) == 1 else 'otherwise'}")


def case_contract(client: httpx.Client) -> Outcome:
    """What /openapi.json allows and the server refused."""
    return _statuses([_post(client, "/tokenize", {}), _post(client, "/v1/completions", _completion(prompt="")),
                      _post(client, "/detokenize", {"model": MODEL, "tokens": [10 ** 9]})])


def case_chat_roles(client: httpx.Client) -> Outcome:
    """Chat messages OpenAI refuses: a tool message without content or tool_call_id, a null user content."""
    chat = {"model": MODEL, "max_tokens": 8}
    return _statuses([_post(client, "/v1/chat/completions", {**chat, "messages": [{"role": "tool"}]}),
                      _post(client, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": None}]})])


def cases() -> dict[str, Callable[[httpx.Client], Outcome]]:
    return {"wedge sequence (outputs unread)": case_wedge_sequence,
            **{name: _grammar_case(extra) for name, extra in GRAMMARS.items()},
            "kept-alive connection": case_keepalive, "chunked 40 MB body": case_chunked_body,
            "abort before first token": case_abort_before_first_token, "OpenAPI contract": case_contract,
            "chat roles": case_chat_roles}


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    # Both outputs are pipes nobody reads: what wedged the server for good before 2026-11-29.
    return start_process(["--served-model-name", MODEL, "--max-model-len", "2048", *extra], unread_pipes=True)


def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1e3:.0f}" if values else "-"


def observe(url: str, stop: Any, out: Any) -> None:
    """The observers' process (their own GIL: the cases' client work must not delay them): the victim and
    the /health poller until `stop` is set, then their records sent on `out`."""
    poller, victim = Poller(url, 0.02), Victim(url)
    threads = [threading.Thread(target=t.run, daemon=True) for t in (poller, victim)]
    for thread in threads:
        thread.start()
    stop.wait()
    victim.stop.set()
    poller.stop.set()
    out.send((victim.gaps_at, poller.samples))


def run_cases(url: str, only: str) -> list[tuple[str, Outcome, float, float]]:
    """(name, outcome, start, end) of each case, on the clock the observers stamp with (CLOCK_MONOTONIC)."""
    done = []
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        for name, run in cases().items():
            if only in name:
                start = time.monotonic()
                outcome = run(client)
                done.append((name, outcome, start, time.monotonic()))
                print(f"  ran {name}: {outcome.statuses}", flush=True)
    return done


def report(done: list[tuple[str, Outcome, float, float]], gaps_at: list, samples: list, alone: tuple) -> None:
    victim = Victim("")
    victim.gaps_at = gaps_at
    quiet = victim.gaps(*alone)
    print(f"victim alone: inter-token gap p50 {_ms(quiet, 0.5)} ms, p99 {_ms(quiet, 0.99)} ms, max {_ms(quiet, 1.0)} ms")
    print(f"{'case':<34} {'statuses':<16} {'time s':>7} {'victim p50/p99/max ms':>22} {'health max ms':>14}  detail")
    for name, outcome, start, end in done:
        gaps = victim.gaps(start, end + 0.2)
        health = [lat for t, lat, _ in samples if start <= t <= end]
        shown = f"{_ms(gaps, 0.5)}/{_ms(gaps, 0.99)}/{_ms(gaps, 1.0)}"
        print(f"{name:<34} {outcome.statuses:<16} {end - start:>7.2f} {shown:>22} {_ms(health, 1.0):>14}  "
              f"{outcome.detail}")
    print(f"/health answered {sum(1 for *_, s in samples if s == 200)} of {len(samples)} polls with 200")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--server-flag", action="append", default=[], help="an extra `kvpilot serve` flag")
    args = parser.parse_args()
    process, url = start_server(args.server_flag)
    ctx = multiprocessing.get_context("spawn")
    stop, (receive, send) = ctx.Event(), ctx.Pipe(duplex=False)
    observer = ctx.Process(target=observe, args=(url, stop, send), daemon=True)
    observer.start()
    try:
        time.sleep(6.0)
        alone = (time.monotonic() - 4.0, time.monotonic())
        done = run_cases(url, args.only)
        alive = process.poll() is None
        stop.set()
        gaps_at, samples = receive.recv()
        report(done, gaps_at, samples, alone)
        print(f"server alive after every case: {alive}")
    finally:
        process.kill()
        process.wait(30)
        observer.join(10)


if __name__ == "__main__":
    main()
