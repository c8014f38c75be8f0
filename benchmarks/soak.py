"""Soak test (issue 14, not in CI): an hour of mixed load against `kvpilot serve`, sampling the server's
memory (RSS) and open file descriptors, to show that nothing grows without bound.

Each round sends, at the same time: a `kvpilot bench` run (chat, streaming, closed loop, random lengths) and
a burst of traffic that exercises the error and cancellation paths: streams cut after their first chunks,
non-streaming clients that give up, requests the server must refuse (400), n=2 fan-outs and a json_object
request. Every `--sample-every-s` the script records RSS and fds of every process of the server (the HTTP
process and its engine-core process), and after each round that the server is idle again (running and
waiting back to 0 on /metrics). Growth is the median of the last tenth of the samples against the median of
the second tenth (the first tenth is warm-up: allocator pools, compiled kernels, caches filling).

    .venv/bin/python benchmarks/soak.py                            # one hour, embedded model, a new server
    .venv/bin/python benchmarks/soak.py --duration-s 600 --json soak.json
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234   # a running server

Against a running server without --pid, RSS and fds come from its /metrics (`process_resident_memory_bytes`,
`process_open_fds`: the HTTP process only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers.kvpilot_engine import kvpilot_server_spec  # noqa: E402
from peers.report import describe_machine  # noqa: E402
from peers.servers import free_port, running_server  # noqa: E402
from peers.workloads import kvpilot_command  # noqa: E402

MIB = 1024 * 1024


@dataclass(frozen=True)
class Sample:
    """One reading: seconds since the start, RSS (MiB) and open fds summed over the server's processes."""

    t_s: float
    rss_mib: float
    num_fds: int
    num_processes: int
    rss_mib_by_pid: dict[int, float] | None = None  # each process of the tree (HTTP, engine core, tracker)


@dataclass(frozen=True)
class RoundResult:
    index: int
    t_s: float
    num_ok: int
    num_failed: int
    ttft_p50_ms: float | None
    num_abuse: int
    abuse_statuses: dict[str, int]
    idle_after: bool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=3600.0, help="how long to keep the load on")
    parser.add_argument("--sample-every-s", type=float, default=10.0, help="seconds between RSS/fd samples")
    parser.add_argument("--url", help="a running server's base URL (default: start `kvpilot serve`)")
    parser.add_argument("--pid", type=int, help="with --url: the server's pid (its children are counted too)")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `kvpilot serve` argument")
    parser.add_argument("--concurrency", type=int, default=8, help="bench streams kept in flight per round")
    parser.add_argument("--requests-per-round", type=int, default=48, help="bench requests per round")
    parser.add_argument("--json", type=Path, help="write the samples, rounds and summary here")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/kvpilot-soak"), help="logs and bench output")
    return parser.parse_args(argv)


class Sampler(threading.Thread):
    """Samples RSS and fds of a process tree (psutil) or of /metrics until stopped."""

    def __init__(self, every_s: float, pid: int | None, metrics_url: str) -> None:
        super().__init__(daemon=True)
        self.every_s, self.pid, self.metrics_url = every_s, pid, metrics_url
        self.samples: list[Sample] = []
        self.started = time.monotonic()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            sample = self.read()
            if sample is not None:
                self.samples.append(sample)
            self._stop_event.wait(self.every_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    def read(self) -> Sample | None:
        t_s = time.monotonic() - self.started
        if self.pid is None:
            metrics = scrape(self.metrics_url)
            rss, fds = metrics.get("process_resident_memory_bytes"), metrics.get("process_open_fds")
            return None if rss is None or fds is None else Sample(t_s, rss / MIB, int(fds), 1)
        try:
            root = psutil.Process(self.pid)
            processes = [root, *root.children(recursive=True)]
            by_pid = {p.pid: p.memory_info().rss / MIB for p in processes}
            fds = sum(p.num_fds() for p in processes)
        except psutil.Error:
            return None
        return Sample(t_s, sum(by_pid.values()), fds, len(processes), by_pid)


def scrape(metrics_url: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text page, plus the summed running/waiting gauges."""
    values: dict[str, float] = {}
    try:
        text = httpx.get(metrics_url, timeout=10).text
    except httpx.HTTPError:
        return values
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        try:
            number = float(value)
        except ValueError:
            continue
        if base in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            values[base] = values.get(base, 0.0) + number
        elif "{" not in name:
            values[base] = number
    return values


def run_bench(url: str, args: argparse.Namespace, index: int) -> tuple[int, int, float | None]:
    """One `kvpilot bench` round: (ok, failed, TTFT p50 ms)."""
    output = args.work_dir / f"round-{index}.json"
    command = [*kvpilot_command(), "bench", "--base-url", url, "--endpoint", "chat", "--stream",
               "--concurrency", str(args.concurrency), "--num-requests", str(args.requests_per_round),
               "--dataset", "random", "--input-len", "96", "--output-len", "48", "--len-dist", "uniform",
               "--range-ratio", "0.8", "--tokenizer", "embedded", "--seed", str(index), "--no-progress",
               "--no-scrape-metrics", "--output", str(output)]
    with (args.work_dir / f"round-{index}.log").open("w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        run = json.loads(output.read_text())["runs"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return 0, args.requests_per_round, None
    ok = [r for r in run["requests"] if r["ok"]]
    ttfts = [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]
    return len(ok), len(run["requests"]) - len(ok), statistics.median(ttfts) if ttfts else None


async def abuse(url: str, index: int) -> dict[str, int]:
    """The error and cancellation paths, a few of each; returns a count per outcome."""
    chat = f"{url}/v1/chat/completions"
    messages = [{"role": "user", "content": f"Round {index}: name three rivers."}]
    outcomes: dict[str, int] = {}

    def count(key: str) -> None:
        outcomes[key] = outcomes.get(key, 0) + 1

    async with httpx.AsyncClient(timeout=60) as client:
        async def cut_stream() -> None:
            body = {"messages": messages, "max_tokens": 64, "stream": True}
            async with client.stream("POST", chat, json=body) as response:
                async for _ in response.aiter_lines():
                    break  # first chunk, then hang up
            count(f"cut-stream:{response.status_code}")

        async def give_up() -> None:
            try:
                await client.post(chat, json={"messages": messages, "max_tokens": 64}, timeout=0.3)
                count("give-up:finished")
            except httpx.TimeoutException:
                count("give-up:left")

        async def post(name: str, body: dict) -> None:
            response = await client.post(chat, json=body)
            count(f"{name}:{response.status_code}")

        tasks = [cut_stream() for _ in range(4)] + [give_up() for _ in range(3)] + [
            post("bad-top-k", {"messages": messages, "top_k": 10**20}),
            post("bad-body", {"messages": "not a list"}),
            post("n2", {"messages": messages, "max_tokens": 12, "n": 2, "seed": index}),
            post("json", {"messages": messages, "max_tokens": 24, "response_format": {"type": "json_object"}}),
        ]
        await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes


def wait_idle(metrics_url: str, max_wait_s: float = 60.0) -> bool:
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        m = scrape(metrics_url)
        if m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:num_requests_waiting", 1) == 0:
            return True
        time.sleep(1)
    return False


def soak(url: str, pid: int | None, args: argparse.Namespace) -> dict:
    sampler = Sampler(args.sample_every_s, pid, f"{url}/metrics")
    sampler.start()
    rounds: list[RoundResult] = []
    index = 0
    while time.monotonic() - sampler.started < args.duration_s:
        outcome: dict[str, tuple[int, int, float | None]] = {}
        bench = threading.Thread(target=lambda: outcome.setdefault("bench", run_bench(url, args, index)))
        bench.start()
        statuses = asyncio.run(abuse(url, index))
        bench.join()
        ok, failed, ttft = outcome["bench"]
        rounds.append(RoundResult(index, time.monotonic() - sampler.started, ok, failed, ttft,
                                  sum(statuses.values()), statuses, wait_idle(f"{url}/metrics")))
        print(f"round {index}: {ok} ok, {failed} failed, TTFT p50 {ttft or float('nan'):.0f} ms, "
              f"last sample {sampler.samples[-1] if sampler.samples else None}", flush=True)
        index += 1
    sampler.stop()
    return {"samples": [asdict(s) for s in sampler.samples], "rounds": [asdict(r) for r in rounds],
            "summary": summarize(sampler.samples, rounds)}


def summarize(samples: list[Sample], rounds: list[RoundResult]) -> dict:
    tenth = max(1, len(samples) // 10)
    early, late = samples[tenth:2 * tenth] or samples[:1], samples[-tenth:]
    rss0, rss1 = statistics.median(s.rss_mib for s in early), statistics.median(s.rss_mib for s in late)
    per_process = {}
    for pid in (early[-1].rss_mib_by_pid or {}):
        first = [s.rss_mib_by_pid[pid] for s in early if s.rss_mib_by_pid and pid in s.rss_mib_by_pid]
        last = [s.rss_mib_by_pid[pid] for s in late if s.rss_mib_by_pid and pid in s.rss_mib_by_pid]
        if first and last:
            per_process[str(pid)] = [statistics.median(first), statistics.median(last)]
    fd0, fd1 = statistics.median(s.num_fds for s in early), statistics.median(s.num_fds for s in late)
    ttfts = [r.ttft_p50_ms for r in rounds if r.ttft_p50_ms is not None]
    return {"num_samples": len(samples), "num_rounds": len(rounds),
            "num_ok": sum(r.num_ok for r in rounds), "num_failed": sum(r.num_failed for r in rounds),
            "rss_mib_early": rss0, "rss_mib_late": rss1, "rss_growth_pct": 100 * (rss1 / rss0 - 1),
            "rss_mib_max": max(s.rss_mib for s in samples), "rss_mib_early_late_by_pid": per_process,
            "fds_early": fd0, "fds_late": fd1,
            "ttft_p50_ms_first_rounds": statistics.median(ttfts[:3]) if ttfts else None,
            "ttft_p50_ms_last_rounds": statistics.median(ttfts[-3:]) if ttfts else None,
            "rounds_not_idle_after": sum(not r.idle_after for r in rounds)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    machine = describe_machine(Path(__file__).resolve().parent.parent)
    print("\n".join(machine.header_lines("soak.py")), flush=True)
    if args.url:
        document = soak(args.url.rstrip("/"), args.pid, args)
    else:
        spec = kvpilot_server_spec(free_port(), psutil.cpu_count() or 1, args.serve_arg)
        with running_server(spec, args.work_dir / "server.log", max_start_s=600) as url:
            pid = next(p.pid for p in psutil.process_iter(["cmdline"])
                       if f"{spec.port}" in " ".join(p.info["cmdline"] or []) and "kvpilot.server" in
                       " ".join(p.info["cmdline"] or []))
            document = soak(url, pid, args)
    summary = document["summary"]
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"machine": asdict(machine), **document}, indent=2))


if __name__ == "__main__":
    main()
