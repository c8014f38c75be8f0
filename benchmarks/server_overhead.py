"""Server overhead: the same workload offline through `LLM` and through `kvpilot serve` (HTTP, SSE streaming).

Same model, weights, dtype, engine settings (max_num_seqs = the client concurrency) and requests (token-id
prompts, ignore_eos, fixed output lengths), one after the other in one run: never two engines at once.
The server runs as its own process (`python -m kvpilot.server`, i.e. `kvpilot serve`), the client in this one.

    .venv/bin/python benchmarks/server_overhead.py                        # 64 requests, 32 concurrent
    .venv/bin/python benchmarks/server_overhead.py --num-requests 16 --concurrency 8 --output-len 32
    python benchmarks/server_overhead.py --model qwen3-0.6b --load-format dummy --kv-cache-memory '' \
        --num-requests 512 --concurrency 256 --input-len 512 --output-len 256 --max-model-len 1024   # a GPU

Target: the server keeps >= 90% of offline throughput (output tokens/s).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.model.step_budget import default_max_num_batched_tokens
from server_process import start_server


def make_prompts(num_requests: int, input_len: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Distinct first tokens: no prefix-cache hits in either run.
    return [[100 + i] + [rng.randrange(1000, vocab) for _ in range(input_len - 1)] for i in range(num_requests)]


def run_offline(args: argparse.Namespace, prompts: list[list[int]]) -> float:
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=args.concurrency,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up, as the server does
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * args.output_len
    return elapsed


async def _one(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> tuple[int, int]:
    """(completion tokens, content chunks) of one streamed request."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
                chunks += bool(event["choices"])
    return tokens, chunks


@dataclass
class ClientRun:
    """What the client saw: wall seconds, tokens, content chunks (fewer than tokens when the server merged
    steps into one chunk: it fell behind), and the client's own CPU seconds (near the wall time: the client
    itself may be what limits the rate). The server's CPU seconds meanwhile, HTTP process and engine core, are
    filled in after the run."""

    seconds: float
    num_tokens: int
    num_chunks: int
    cpu_seconds: float
    http_cpu_seconds: float = 0.0
    core_cpu_seconds: float = 0.0


async def _client_run(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> ClientRun:
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        async def worker() -> tuple[int, int]:
            tokens = chunks = 0
            while not queue.empty():
                one = await _one(client, queue.get_nowait(), output_len)
                tokens, chunks = tokens + one[0], chunks + one[1]
            return tokens, chunks

        start, cpu_start = time.perf_counter(), time.process_time()
        totals = await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ClientRun(time.perf_counter() - start, sum(t for t, _ in totals), sum(c for _, c in totals),
                         time.process_time() - cpu_start)


def run_server(args: argparse.Namespace, prompts: list[list[int]]) -> ClientRun:
    model = ["--model", args.model, "--load-format", args.load_format] if args.model else []
    memory = ["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else []
    process, url = start_server([*model, *memory, "--dtype", args.dtype, "--max-num-seqs", str(args.concurrency),
                                 "--max-model-len", str(args.max_model_len), "--served-model-name", "bench",
                                 "--max-num-batched-tokens", str(args.max_num_batched_tokens)],
                                log_path=args.server_log)
    spy = _start_py_spy(process.pid, args.py_spy) if args.py_spy else None
    cpu = ServerCpu(process.pid)
    try:
        if args.client == "bench":
            run = _kvpilot_bench(url, args)
        else:
            run = asyncio.run(_client_run(url, prompts, args.output_len, args.concurrency)) \
                if args.client_processes == 1 else _multi_process_client(url, prompts, args)
            assert run.num_tokens == len(prompts) * args.output_len, f"{run.num_tokens} tokens streamed"
        run.http_cpu_seconds, run.core_cpu_seconds = cpu.since_start()
        return run
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            spy.wait(timeout=60)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


class ServerCpu:
    """CPU seconds the server's HTTP process and its children (the engine core) spent since this was made:
    the front end's cost per streamed chunk is the HTTP process's share divided by the chunks."""

    def __init__(self, pid: int) -> None:
        self._http = psutil.Process(pid)
        self._start = self._read()

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


def _kvpilot_bench(url: str, args: argparse.Namespace) -> ClientRun:
    """`kvpilot bench` as the client: text prompts of --input-len tokens of the embedded tokenizer (a dummy
    model borrows it; see tokenizer_only_gguf.py where the model package is missing), greedy, ignore_eos.
    Chunks and client CPU are not reported by bench: 0 and -1."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "bench.json"
        command = [sys.executable, "-c", "from kvpilot.cli import main; main()", "bench", "--base-url", url,
                   "--model", "bench", "--concurrency", str(args.concurrency), "--num-requests",
                   str(args.num_requests), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   "--ignore-eos", "--temperature", "0", "--tokenizer", "embedded", "--no-progress",
                   "--no-scrape-metrics", "--client-processes", str(args.client_processes), "--output", str(result)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"kvpilot bench failed ({done.returncode}): {done.stderr[-2000:]}")
        print("\n".join(line for line in done.stdout.splitlines() if "CLIENT" in line or "client kept up" in line))
        run = json.loads(result.read_text())["runs"][0]
    aggregates = run["aggregates"]
    assert aggregates["num_errors"] == 0, f"{aggregates['num_errors']} requests failed"
    num_tokens = round(aggregates["output_token_throughput"] * aggregates["duration_s"])
    return ClientRun(aggregates["duration_s"], num_tokens, 0, -1.0)  # bench counts no chunks


def _client_process(url: str, prompts: list[list[int]], output_len: int, concurrency: int, barrier: Any,
                    results: Any) -> None:
    barrier.wait()  # every process has imported and connected nothing yet: start together
    start = time.time()
    run = asyncio.run(_client_run(url, prompts, output_len, concurrency))
    results.put((start, time.time(), run))


def _multi_process_client(url: str, prompts: list[list[int]], args: argparse.Namespace) -> ClientRun:
    """The same closed loop split over --client-processes processes (requests and streams dealt round-robin),
    so that one Python client's CPU does not cap the rate. Wall time: the first start to the last end."""
    n = args.client_processes
    ctx = multiprocessing.get_context("spawn")  # this process holds CUDA state from the offline run
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(url, prompts[i::n], args.output_len,
                                                      len(range(i, args.concurrency, n)), barrier, results))
             for i in range(n)]
    for proc in procs:
        proc.start()
    runs = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    return ClientRun(max(end for _, end, _ in runs) - min(start for start, _, _ in runs),
                     sum(r.num_tokens for _, _, r in runs), sum(r.num_chunks for _, _, r in runs),
                     sum(r.cpu_seconds for _, _, r in runs))


def _vocab_size(args: argparse.Namespace) -> int:
    if args.model is None:
        return 49152
    from kvpilot.fit.model_catalog import get_hf_config  # a catalog name, or read from the config.json

    if args.model.endswith(".json"):
        return json.loads(open(args.model).read())["vocab_size"]
    return get_hf_config(args.model)["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="'' (empty): the device's default (CUDA: from "
                        "--gpu-memory-utilization)")
    parser.add_argument("--model", default=None, help="Default: the embedded model. A catalog name or config.json "
                        "with --load-format dummy runs anywhere (a GPU machine without the GGUF).")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="Both engines' step budget "
                        "(default: the server's default on this device; offline LLM's own default is larger on a GPU)")
    parser.add_argument("--client", choices=("python", "bench"), default="python", help="python: this script's "
                        "own streaming client (token-id prompts); bench: `kvpilot bench` (text prompts, needs the "
                        "embedded tokenizer).")
    parser.add_argument("--client-processes", type=int, default=1, help="Split the client over this many "
                        "processes (a lone Python client may not keep up with hundreds of fast streams).")
    parser.add_argument("--py-spy", default=None, metavar="PATH", help="Sample the server's processes with "
                        "py-spy during the client run into PATH (raw folded stacks; see pyspy_summary.py).")
    parser.add_argument("--server-log", default=None, help="Write the server's own output here (default: discarded).")
    args = parser.parse_args()
    args.kv_cache_memory = args.kv_cache_memory or None
    if args.max_num_batched_tokens is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args.max_num_batched_tokens = default_max_num_batched_tokens(device, args.concurrency, "server")
    prompts = make_prompts(args.num_requests, args.input_len, args.seed, vocab=min(_vocab_size(args), 49152))
    num_tokens = args.num_requests * args.output_len
    offline_s = run_offline(args, prompts)
    gc.collect()  # the engine holds reference cycles: free its (GPU) memory before the server sizes its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    client = run_server(args, prompts)
    server_s = client.seconds
    offline_tps, server_tps = num_tokens / offline_s, num_tokens / server_s
    print(f"workload: {args.num_requests} requests, {args.concurrency} concurrent, {args.input_len} in / "
          f"{args.output_len} out (ignore_eos), dtype {args.dtype}, step budget {args.max_num_batched_tokens}")
    print(f"offline LLM.generate : {offline_tps:8.1f} output tokens/s ({offline_s:.1f} s)")
    print(f"HTTP server streaming: {server_tps:8.1f} output tokens/s ({server_s:.1f} s)")
    print(f"server / offline     : {server_tps / offline_tps:8.1%}  (target >= 90%)")
    print(f"server CPU           : HTTP process {client.http_cpu_seconds:.1f} s "
          f"({client.http_cpu_seconds / num_tokens * 1e6:.0f} us a token), engine core {client.core_cpu_seconds:.1f} s, "
          f"of {server_s:.1f} s wall")
    if args.client == "bench":
        print(f"client               : kvpilot bench, {args.client_processes} process(es)")
        return
    print(f"client               : {client.num_chunks} chunks for {client.num_tokens} tokens "
          f"({client.num_tokens / client.num_chunks:.2f} a chunk), client CPU {client.cpu_seconds:.1f} s of "
          f"{client.seconds:.1f} s wall; HTTP process {client.http_cpu_seconds / client.num_chunks * 1e6:.0f} us "
          f"a chunk")


if __name__ == "__main__":
    main()
