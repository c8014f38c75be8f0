"""Prefill/decode disaggregation (issue #49 item 2) side by side in one run, on the same cores: 1 prefill + 1
decode worker behind `kvpilot proxy --prefill --decode`, against 2 mixed workers behind `kvpilot proxy --worker`
(the same proxy, least busy first). Each worker is pinned to its own core (taskset) with one OpenMP thread; the
proxy and this load run unpinned in both set-ups.

The load: `--chats` streaming chats in a closed loop (short prompts, `--chat-tokens` out each, ignore_eos),
and `--long-streams` clients sending `--long-tokens`-token prompts (a few tokens out) in a closed loop beside
them. Printed per set-up: the chats' inter-token latency p50/p99 (gaps between a stream's content chunks; a
chunk carrying several steps' tokens, sent when the client fell behind, counts as one gap), their TTFT p50,
the long prompts' latency, and the total token throughput (prompt + output tokens of every finished request
/ wall time, vLLM bench's "total token throughput"); then the ratios (goal: ITL p99 mixed / disaggregated
>= 3x, throughput disaggregated / mixed >= 0.8x), median over passes with the spread. A pass with a failed
request is dropped (and said so).

    .venv/bin/python benchmarks/disaggregation.py                  # 3 passes of 40 s per set-up
    .venv/bin/python benchmarks/disaggregation.py --smoke          # one short pass: does it run
Record results in docs/benchmark-log.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import aiohttp
import httpx

sys.path.insert(0, os.path.dirname(__file__))
from server_process import start_server  # noqa: E402

from kvpilot.server.background import free_port  # noqa: E402

GOAL_ITL, GOAL_THROUGHPUT = 3.0, 0.8


@dataclass(frozen=True)
class Load:
    chats: int
    chat_prompt_tokens: int
    chat_tokens: int
    long_streams: int
    long_tokens: int
    seconds: float


@dataclass
class Tally:
    """What one set-up's pass saw."""

    itls: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    long_latencies: list[float] = field(default_factory=list)
    num_tokens: int = 0
    num_failed: int = 0

    def summary(self, seconds: float) -> dict[str, float]:
        itls = sorted(self.itls)
        return {"itl_p50_ms": 1e3 * _quantile(itls, 0.5), "itl_p99_ms": 1e3 * _quantile(itls, 0.99),
                "ttft_p50_ms": 1e3 * _quantile(sorted(self.ttfts), 0.5),
                "long_p50_s": _quantile(sorted(self.long_latencies), 0.5),
                "num_long": len(self.long_latencies), "tokens_per_s": self.num_tokens / seconds}


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(n)]


async def _stream(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                  tally: Tally, chat: bool) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started = last = time.perf_counter()
    first, usage = True, None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            tally.num_failed += 1
            await resp.read()
            return
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            if not event.get("choices") or not event["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if chat and first:
                tally.ttfts.append(now - started)
            elif chat:
                tally.itls.append(now - last)
            first, last = False, now
    if usage is None:
        tally.num_failed += 1
        return
    tally.num_tokens += usage["prompt_tokens"] + usage["completion_tokens"]
    if not chat:
        tally.long_latencies.append(time.perf_counter() - started)


async def _client(url: str, load: Load, tally: Tally, chat: bool, seed: int, deadline: float) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.perf_counter() < deadline:
            if chat:
                await _stream(session, url, _prompt(rng, load.chat_prompt_tokens), load.chat_tokens, tally, True)
            else:
                await _stream(session, url, _prompt(rng, load.long_tokens), 4, tally, False)


async def run_load(url: str, load: Load, seed: int) -> Tally:
    tally = Tally()
    deadline = time.perf_counter() + load.seconds
    clients = [_client(url, load, tally, True, seed + i, deadline) for i in range(load.chats)]
    clients += [_client(url, load, tally, False, seed + 1000 + i, deadline) for i in range(load.long_streams)]
    await asyncio.gather(*clients)
    return tally


@contextmanager
def worker(core: int, flags: list[str]) -> Iterator[str]:
    """`kvpilot serve` pinned to one core with one OpenMP thread; yields its URL."""
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS",)}
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        process, url = start_server(["--max-model-len", "8192", *flags], timeout_s=600)
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(process.pid)], check=True, capture_output=True)
    for child in _children(process.pid):  # the engine-core process
        subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(child)], check=True, capture_output=True)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(30)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@contextmanager
def proxy(args: list[str]) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", "proxy", "--port", str(port), *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise RuntimeError("kvpilot proxy did not become healthy")
        yield url
    finally:
        process.terminate()
        process.wait(30)


@contextmanager
def deployment(kind: str, extra: list[str]) -> Iterator[str]:
    with ExitStack() as stack:
        if kind == "disaggregated":
            prefill = stack.enter_context(worker(0, ["--kv-role", "prefill", *extra]))
            decode = stack.enter_context(worker(1, ["--kv-role", "decode", *extra]))
            url = stack.enter_context(proxy(["--prefill", prefill, "--decode", decode]))
        else:
            first = stack.enter_context(worker(0, extra))
            second = stack.enter_context(worker(1, extra))
            url = stack.enter_context(proxy(["--worker", first, "--worker", second]))
        asyncio.run(run_load(url, Load(2, 16, 4, 1, 64, 3.0), seed=7))  # warm both workers' paths
        yield url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one short pass: does it run")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--chat-prompt-tokens", type=int, default=64)
    parser.add_argument("--chat-tokens", type=int, default=64)
    parser.add_argument("--long-streams", type=int, default=1)
    parser.add_argument("--long-tokens", type=int, default=4096)
    parser.add_argument("--only", choices=("mixed", "disaggregated"), help="run one set-up (no ratio)")
    parser.add_argument("--serve-flag", action="append", default=[], help="extra `kvpilot serve` flag (repeat)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.passes, args.seconds, args.chats, args.long_tokens = 1, 8.0, 4, 1024
    load = Load(args.chats, args.chat_prompt_tokens, args.chat_tokens, args.long_streams, args.long_tokens,
                args.seconds)
    print(f"load: {load}", flush=True)
    results: dict[str, list[dict[str, float]]] = {"mixed": [], "disaggregated": []}
    for index in range(args.passes):
        kinds = ["mixed", "disaggregated"] if index % 2 == 0 else ["disaggregated", "mixed"]
        kinds = [kind for kind in kinds if args.only in (None, kind)]
        for kind in kinds:  # alternating order: a drifting machine favours neither
            with deployment(kind, args.serve_flag) as url:
                tally = asyncio.run(run_load(url, load, seed=100 * index))
            row = tally.summary(load.seconds)
            print(f"pass {index} {kind:>13}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items())
                  + (f"  DROPPED: {tally.num_failed} failed requests" if tally.num_failed else ""), flush=True)
            if not tally.num_failed:
                results[kind].append(row)
    _report(results)
    return 0


def _report(results: dict[str, list[dict[str, float]]]) -> None:
    pairs = list(zip(results["mixed"], results["disaggregated"]))
    if not pairs:
        print("no pass without failed requests: nothing to compare")
        return
    itl = sorted(m["itl_p99_ms"] / d["itl_p99_ms"] for m, d in pairs)
    tput = sorted(d["tokens_per_s"] / m["tokens_per_s"] for m, d in pairs)
    for name, key in (("mixed", "itl_p99_ms"), ("disaggregated", "itl_p99_ms")):
        print(f"{name:>13} ITL p99 median {statistics.median(r[key] for r in results[name]):.1f} ms, "
              f"throughput {statistics.median(r['tokens_per_s'] for r in results[name]):.1f} tok/s")
    print(f"ITL p99 mixed / disaggregated: {statistics.median(itl):.2f}x ({itl[0]:.2f}-{itl[-1]:.2f}), "
          f"goal >= {GOAL_ITL}x")
    print(f"throughput disaggregated / mixed: {statistics.median(tput):.2f}x ({tput[0]:.2f}-{tput[-1]:.2f}), "
          f"goal >= {GOAL_THROUGHPUT}x")


if __name__ == "__main__":
    sys.exit(main())
