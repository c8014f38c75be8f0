"""Server overhead: the same workload offline through `LLM` and through `kvpilot serve` (HTTP, SSE streaming).

Same model, weights, dtype, engine settings (max_num_seqs = the client concurrency) and requests (token-id
prompts, ignore_eos, fixed output lengths). The server runs as its own process (`python -m kvpilot.server`,
i.e. `kvpilot serve`), the client (stream_client.py) in this one. --rounds N alternates offline and served
runs N times, each round on fresh prompts (no prefix-cache hits), and prints each round's ratio and their
median: a small box drifts by +-5% within minutes, more than the overhead measured. Both engines stay loaded
across rounds, never running at once (the idle one blocks on its queue); on a GPU that needs an explicit
--kv-cache-memory for each, so without one a GPU run does a single round, offline first and freed before the
server sizes its cache.

    .venv/bin/python benchmarks/server_overhead.py                        # 64 requests, 32 concurrent, 3 rounds
    .venv/bin/python benchmarks/server_overhead.py --num-requests 128 --concurrency 64 --output-len 64
    python benchmarks/server_overhead.py --model qwen3-0.6b --load-format dummy --kv-cache-memory '' \
        --num-requests 512 --concurrency 256 --input-len 512 --output-len 256 --max-model-len 1024   # a GPU

Target: the server keeps >= 95% of offline throughput (output tokens/s) at 64 streams on the 2-core CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.model.step_budget import default_max_num_batched_tokens
from server_process import start_server
from stream_client import MIN_POLL_INTERVAL_S, ClientRun, multi_process_client, run_client


def make_prompts(num_requests: int, input_len: int, seed: int, vocab: int) -> list[list[int]]:
    """Round `seed`'s prompts: first tokens distinct within and across rounds, so no prefix-cache hits."""
    rng = random.Random(seed)
    first = 100 + seed * num_requests
    return [[first + i] + [rng.randrange(1000, vocab) for _ in range(input_len - 1)] for i in range(num_requests)]


def load_offline(args: argparse.Namespace) -> LLM:
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=args.concurrency, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up, as the server does
    return llm


def run_offline(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, float, int, int]:
    """(wall seconds, this process's CPU seconds, engine steps, preemptions of this process's threads) of one
    LLM.generate over every prompt."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    steps: list[int] = []
    llm.engine.on_step = lambda stats: steps.append(stats.num_batched_tokens)
    start, cpu_start, preempted = time.perf_counter(), time.process_time(), preemptions(os.getpid())
    outputs = llm.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    preempted = preemptions(os.getpid()) - preempted
    llm.engine.on_step = None
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * output_len
    return elapsed, cpu, len(steps), preempted


def served_steps(url: str) -> int:
    """Engine steps the server has run: the count of its `vllm:iteration_tokens_total` histogram."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("vllm:iteration_tokens_total_count"))


class Served:
    """`kvpilot serve` on the same settings, started once for every round (py-spy, when asked, samples all of
    them); `run(prompts, seed)` streams one round through it and fills in the server's CPU for that round."""

    def __init__(self, args: argparse.Namespace) -> None:
        model = ["--model", args.model, "--load-format", args.load_format] if args.model else []
        memory = ["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else []
        self.args = args
        self.process, self.url = start_server(
            [*model, *memory, "--dtype", args.dtype, "--quantization", args.quantization, "--max-num-seqs",
             str(args.concurrency), "--max-model-len", str(args.max_model_len), "--served-model-name", "bench", "--max-num-batched-tokens",
             str(args.max_num_batched_tokens)], log_path=args.server_log)
        self.spy = _start_py_spy(self.process.pid, args.py_spy) if args.py_spy else None

    def run(self, prompts: list[list[int]], seed: int) -> ClientRun:
        args, cpu, steps = self.args, ServerCpu(self.process.pid), served_steps(self.url)
        if args.client == "bench":
            run = _kvpilot_bench(self.url, args, seed)
        else:
            run = run_client(args.client, self.url, prompts, args.output_len, args.concurrency,
                             args.client_poll_ms / 1000) \
                if args.client_processes == 1 else \
                multi_process_client(self.url, prompts, args.output_len, args.concurrency, args.client_processes,
                                     args.client)
            assert run.num_tokens == len(prompts) * args.output_len, f"{run.num_tokens} tokens streamed"
        run.http_cpu_seconds, run.core_cpu_seconds = cpu.since_start()
        run.core_preemptions = cpu.core_preemptions()
        run.num_steps = served_steps(self.url) - steps
        return run

    def close(self) -> None:
        if self.spy is not None:
            self.spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            self.spy.wait(timeout=60)
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


def preemptions(pid: int) -> int:
    """Times the threads of process `pid` were switched out while runnable (Linux's nonvoluntary context
    switches, summed over its threads; 0 where /proc has none). An engine thread preempted mid-step stalls
    its partner at the next barrier: served against offline, these count how often the front end and the
    client took an engine thread's core."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # the thread ended meanwhile
            continue
        total += sum(int(line.split()[1]) for line in text.splitlines()
                     if line.startswith("nonvoluntary_ctxt_switches"))
    return total


class ServerCpu:
    """CPU seconds the server's HTTP process and its children (the engine core) spent since this was made, and
    the engine core's preemptions: the front end's cost per streamed chunk is the HTTP process's share
    divided by the chunks."""

    def __init__(self, pid: int) -> None:
        self._http = psutil.Process(pid)
        self._start = self._read()
        self._preempted = self._core_preemptions()

    def _core_preemptions(self) -> int:
        return sum(preemptions(child.pid) for child in self._http.children(recursive=True))

    def core_preemptions(self) -> int:
        return self._core_preemptions() - self._preempted

    def _read(self) -> tuple[float, float]:
        def busy(proc: psutil.Process) -> float:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                return 0.0
            return times.user + times.system

        return busy(self._http), sum(busy(child) for child in self._http.children(recursive=True))

    def since_start(self) -> tuple[float, float]:
        (http0, core0), (http1, core1) = self._start, self._read()
        return http1 - http0, core1 - core0


PY_SPY_RATE = 200  # samples a second


def _start_py_spy(pid: int, path: str) -> subprocess.Popen:
    """py-spy sampling the server and its engine core process (and threads) while the client runs; its raw
    folded stacks go to `path` (summarize them with pyspy_summary.py)."""
    # on PATH, beside this Python (a venv), or in a --target install's bin/ on sys.path (the GPU machine's /tmp/site)
    places = [Path(sys.executable).parent / "py-spy", *(Path(p) / "bin" / "py-spy" for p in sys.path if p)]
    binary = shutil.which("py-spy") or next((str(p) for p in places if p.is_file()), None)
    if binary is None:
        raise RuntimeError("--py-spy: no py-spy here (pip install py-spy; on the GPU machine it comes from .whl)")
    spy = subprocess.Popen([binary, "record", "-p", str(pid), "--subprocesses", "--threads", "--nonblocking",
                            "--rate", str(PY_SPY_RATE),
                            "--format", "raw", "-o", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached before the load starts
    return spy


def _kvpilot_bench(url: str, args: argparse.Namespace, seed: int) -> ClientRun:
    """`kvpilot bench` as the client: text prompts of --input-len tokens of the embedded tokenizer (a dummy
    model borrows it; see tokenizer_only_gguf.py where the model package is missing), greedy, ignore_eos.
    Chunks and client CPU are not reported by bench: 0 and -1."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "bench.json"
        command = [sys.executable, "-c", "from kvpilot.cli import main; main()", "bench", "--base-url", url,
                   "--model", "bench", "--concurrency", str(args.concurrency), "--num-requests",
                   str(args.num_requests), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   "--ignore-eos", "--temperature", "0", "--tokenizer", "embedded", "--no-progress",
                   "--no-scrape-metrics", "--client-processes", str(args.client_processes), "--seed", str(seed),
                   "--output", str(result)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"kvpilot bench failed ({done.returncode}): {done.stderr[-1000:]}\n"
                               f"its output ends: {done.stdout[-1500:]}")  # bench prints request errors there
        print("\n".join(line for line in done.stdout.splitlines() if "CLIENT" in line or "client kept up" in line))
        run = json.loads(result.read_text())["runs"][0]
    aggregates = run["aggregates"]
    assert aggregates["num_errors"] == 0, f"{aggregates['num_errors']} requests failed"
    num_tokens = round(aggregates["output_token_throughput"] * aggregates["duration_s"])
    return ClientRun(aggregates["duration_s"], num_tokens, 0, -1.0)  # bench counts no chunks


def _vocab_size(args: argparse.Namespace) -> int:
    if args.model is None:
        return 49152
    from kvpilot.fit.model_catalog import get_hf_config  # a catalog name, or read from the config.json

    if args.model.endswith(".json"):
        return json.loads(open(args.model).read())["vocab_size"]
    if args.model.endswith(".gguf"):
        import gguf

        return len(gguf.GGUFReader(args.model).fields["tokenizer.ggml.tokens"].data)
    return get_hf_config(args.model)["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", help="both engines' --quantization (none with --dtype "
                        "bfloat16: the dense bf16 model of peers_cpu.py's bf16 comparison)")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="'' (empty): the device's default (CUDA: from "
                        "--gpu-memory-utilization)")
    parser.add_argument("--model", default=None, help="Default: the embedded model. A catalog name or config.json "
                        "with --load-format dummy runs anywhere (a GPU machine without the GGUF).")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="Both engines' step budget "
                        "(default: the server's default on this device; offline LLM's own default is larger on a GPU)")
    parser.add_argument("--client", choices=("wire", "aiohttp", "bench"), default="wire", help="wire: this "
                        "script's own streaming client, counting chunks in the raw bytes (token-id prompts); "
                        "aiohttp: the same loop through aiohttp (~4x the client CPU); bench: `kvpilot bench` (text "
                        "prompts, needs the embedded tokenizer).")
    parser.add_argument("--client-poll-ms", type=float, default=MIN_POLL_INTERVAL_S * 1000, help="The wire "
                        "client polls its sockets at most this often (stream_client.py: fewer wake-ups that "
                        "preempt the engine's threads on a small box); 0: as soon as data arrives.")
    parser.add_argument("--client-processes", type=int, default=1, help="Split the client over this many "
                        "processes (a lone Python client may not keep up with hundreds of fast streams).")
    parser.add_argument("--py-spy", default=None, metavar="PATH", help="Sample the server's processes with "
                        "py-spy during the client run into PATH (raw folded stacks; see pyspy_summary.py).")
    parser.add_argument("--server-log", default=None, help="Write the server's own output here (default: discarded).")
    parser.add_argument("--rounds", type=int, default=3, help="Alternate offline and served runs this many "
                        "times (fresh prompts each); the ratio printed last is their median.")
    args = parser.parse_args()
    args.kv_cache_memory = args.kv_cache_memory or None
    if args.max_num_batched_tokens is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args.max_num_batched_tokens = default_max_num_batched_tokens(device, args.concurrency, "server")
    if args.rounds > 1 and args.kv_cache_memory is None and torch.cuda.is_available():
        print(f"--rounds {args.rounds}: one round, since both engines would size their caches from the free GPU "
              "memory (give --kv-cache-memory to keep both loaded)")
        args.rounds = 1
    print(f"workload: {args.num_requests} requests, {args.concurrency} concurrent, {args.input_len} in / "
          f"{args.output_len} out (ignore_eos), dtype {args.dtype}, step budget {args.max_num_batched_tokens}, "
          f"{args.rounds} round(s)", flush=True)
    vocab = min(_vocab_size(args), 49152)
    rounds = [make_prompts(args.num_requests, args.input_len, args.seed + r, vocab) for r in range(args.rounds)]
    llm, served = load_offline(args), None
    try:
        results = []
        for r, prompts in enumerate(rounds):
            offline = run_offline(llm, prompts, args.output_len)
            if args.rounds == 1:
                llm = None  # free it (and its GPU memory) before the server sizes its cache
                gc.collect()  # the engine holds reference cycles
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            served = served or Served(args)
            results.append((offline, served.run(prompts, args.seed + r)))
            _print_round(args, r, *results[-1])
    finally:
        if served is not None:
            served.close()
    _print_summary(args, results)


def _print_round(args: argparse.Namespace, r: int, offline: tuple[float, float, int, int],
                 client: ClientRun) -> None:
    num_tokens = args.num_requests * args.output_len
    (offline_s, offline_cpu, offline_steps, offline_preempted), server_s = offline, client.seconds
    ratio = offline_s / server_s
    print(f"round {r + 1}: offline {num_tokens / offline_s:7.1f} tok/s ({offline_s:.1f} s, CPU {offline_cpu:.1f} s), "
          f"served {num_tokens / server_s:7.1f} tok/s ({server_s:.1f} s; CPU: engine core "
          f"{client.core_cpu_seconds:.1f} s, HTTP process {client.http_cpu_seconds:.1f} s = "
          f"{client.http_cpu_seconds / num_tokens * 1e6:.0f} us a token, client "
          f"{'-' if client.cpu_seconds < 0 else f'{client.cpu_seconds:.1f} s'}): {ratio:6.1%}", flush=True)
    # More steps served than offline for the same tokens: emptier batches (a finished stream's slot waits for
    # the client's next request, where offline the next one is already queued).
    chunks = f"{client.num_chunks} chunks for {client.num_tokens} tokens " \
             f"({client.num_tokens / client.num_chunks:.2f} a chunk), " if args.client != "bench" else ""
    print(f"         {chunks}engine steps: offline {offline_steps}, served {client.num_steps}; engine threads "
          f"preempted: offline {offline_preempted}, served {client.core_preemptions}")


def _print_summary(args: argparse.Namespace, results: list[tuple[tuple[float, float, int, int], ClientRun]]) -> None:
    num_tokens = args.num_requests * args.output_len
    offline_tps = statistics.median(num_tokens / o[0] for o, _ in results)
    served_tps = statistics.median(num_tokens / c.seconds for _, c in results)
    ratio = statistics.median(o[0] / c.seconds for o, c in results)
    client = "kvpilot bench" if args.client == "bench" else f"stream_client.py, {args.client}"
    print(f"offline LLM.generate : {offline_tps:8.1f} output tokens/s (median of {len(results)})")
    print(f"HTTP server streaming: {served_tps:8.1f} output tokens/s (median; client: {client}, "
          f"{args.client_processes} process(es))")
    print(f"server / offline     : {ratio:8.1%}  (median of the rounds' ratios; target >= 95% at 64 streams on the "
          "2-core CPU)")


if __name__ == "__main__":
    main()
