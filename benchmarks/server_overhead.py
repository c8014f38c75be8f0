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
import random
import signal
import time

import httpx
import torch

from kvpilot import LLM, SamplingParams
from server_process import start_server


def make_prompts(num_requests: int, input_len: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Distinct first tokens: no prefix-cache hits in either run.
    return [[100 + i] + [rng.randrange(1000, vocab) for _ in range(input_len - 1)] for i in range(num_requests)]


def run_offline(args: argparse.Namespace, prompts: list[list[int]]) -> float:
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=args.concurrency,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up, as the server does
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * args.output_len
    return elapsed


async def _one(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> int:
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


async def _client_run(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> tuple[float, int]:
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        async def worker() -> int:
            total = 0
            while not queue.empty():
                total += await _one(client, queue.get_nowait(), output_len)
            return total

        start = time.perf_counter()
        totals = await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, sum(totals)


def run_server(args: argparse.Namespace, prompts: list[list[int]]) -> float:
    model = ["--model", args.model, "--load-format", args.load_format] if args.model else []
    memory = ["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else []
    process, url = start_server([*model, *memory, "--dtype", args.dtype, "--max-num-seqs", str(args.concurrency),
                                 "--max-model-len", str(args.max_model_len), "--served-model-name", "bench"],
                                log_path=args.server_log)
    try:
        elapsed, tokens = asyncio.run(_client_run(url, prompts, args.output_len, args.concurrency))
        assert tokens == len(prompts) * args.output_len, f"{tokens} tokens streamed"
        return elapsed
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


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
    parser.add_argument("--server-log", default=None, help="Write the server's own output here (default: discarded).")
    args = parser.parse_args()
    args.kv_cache_memory = args.kv_cache_memory or None
    prompts = make_prompts(args.num_requests, args.input_len, args.seed, vocab=min(_vocab_size(args), 49152))
    num_tokens = args.num_requests * args.output_len
    offline_s = run_offline(args, prompts)
    gc.collect()  # the engine holds reference cycles: free its (GPU) memory before the server sizes its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    server_s = run_server(args, prompts)
    offline_tps, server_tps = num_tokens / offline_s, num_tokens / server_s
    print(f"workload: {args.num_requests} requests, {args.concurrency} concurrent, {args.input_len} in / "
          f"{args.output_len} out (ignore_eos), dtype {args.dtype}")
    print(f"offline LLM.generate : {offline_tps:8.1f} output tokens/s ({offline_s:.1f} s)")
    print(f"HTTP server streaming: {server_tps:8.1f} output tokens/s ({server_s:.1f} s)")
    print(f"server / offline     : {server_tps / offline_tps:8.1%}  (target >= 90%)")


if __name__ == "__main__":
    main()
