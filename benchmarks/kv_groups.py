"""KV groups (issue #45, engine/kv_groups.py) side by side in one run: an interleaved local/global model served
from the same KV memory with a block table per layer kind (the default) and with one table for every layer
(--disable-hybrid-kv-cache-manager, kvpilot's behaviour before). Prints, for each: the requests the pool holds
at once by the engine's own arithmetic, the preemptions, the wall time and output throughput of a burst of long
prompts, and the ratio of their throughputs (median over alternating passes, with the spread); and whether the
greedy outputs were identical.

    .venv/bin/python benchmarks/kv_groups.py            # 3 passes, 16 requests of 1,024 + 256 tokens (minutes)
    .venv/bin/python benchmarks/kv_groups.py --smoke    # 1 short pass: does it run
    .venv/bin/python benchmarks/kv_groups.py --requests 24 --prompt-tokens 2048 --passes 5

The model is Gemma 3 1B's layer shape (hidden 1,152, 4 query heads, 1 KV head of 256, MLP 6,912; five local
layers with a window then one global) at 6 layers, dummy weights, a 16k vocabulary: the attention layout and the
local/global mix are what decide the KV memory. The pool is sized to hold `--pool-requests` whole requests with
one table; both engines get the same bytes. Record results in docs/benchmark-log.md with the date and machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpilot import LLM, SamplingParams

GEMMA3_1B_LAYER = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
                   "intermediate_size": 6912, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                   "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                   "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6, "hidden_activation":
                   "gelu_pytorch_tanh", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


@dataclass(frozen=True)
class RunResult:
    """One engine's burst: seconds, output tokens, preemptions, requests its pool holds at once, the outputs."""

    seconds: float
    num_output_tokens: int
    num_preemptions: int
    concurrency: tuple[float, float]
    outputs: list[list[int]]

    @property
    def output_tps(self) -> float:
        return self.num_output_tokens / self.seconds


def write_model(directory: Path, layers: int, window: int, vocab: int, max_len: int) -> None:
    config = {**GEMMA3_1B_LAYER, "num_hidden_layers": layers, "sliding_window": window, "vocab_size": vocab,
              "max_position_embeddings": max_len}
    (directory / "config.json").write_text(json.dumps(config))


def concurrency(llm: LLM, request_tokens: int) -> tuple[float, float]:
    """Requests of request_tokens the pool holds at once: by the admission's count (a sliding group holding a
    whole prompt chunk beside its window), and while they decode (a sliding group its window's blocks only)."""
    cache, limits = llm.engine.scheduler.cache_config, llm.engine.scheduler_config
    admitted = cache.max_blocks_per_request(request_tokens, limits.max_num_batched_tokens)
    return cache.num_blocks / admitted, cache.num_blocks / cache.max_blocks_per_request(request_tokens, 1)


def run_burst(llm: LLM, prompts: list[list[int]], max_tokens: int) -> RunResult:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return RunResult(seconds, sum(len(t) for t in tokens), sum(o.metrics.num_preemptions for o in outputs),
                     concurrency(llm, len(prompts[0]) + max_tokens), tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one short pass (seconds): does it run")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--pool-requests", type=float, default=4.0,
                        help="whole requests the pool holds with one block table")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    if args.smoke:
        args.passes, args.requests, args.prompt_tokens, args.output_tokens, args.layers = 1, 4, 128, 4, 6
        args.window, args.pool_requests = 32, 2.0
    request_tokens = args.prompt_tokens + args.output_tokens
    directory = Path(tempfile.mkdtemp(prefix="kv-groups-"))
    write_model(directory, args.layers, args.window, 16384, request_tokens + 16)
    base = LLM(model=str(directory), load_format="dummy", dtype=args.dtype, kv_cache_memory="16MiB",
               max_model_len=request_tokens, max_num_seqs=1)
    config = base.loaded.config
    element = torch.tensor([], dtype=base.loaded.dtype).element_size()  # the KV is stored in the model's dtype
    bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element
    budget = int((args.pool_requests * request_tokens + 16) * bytes_per_token)
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 16000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    print(f"{args.requests} requests of {args.prompt_tokens} + {args.output_tokens} tokens; {args.layers} layers "
          f"(window {args.window} on 5 of every 6); KV memory {budget / 2**20:.1f} MiB ({args.pool_requests:g} "
          f"whole requests with one table); {args.passes} pass(es)")
    ratios, identical = [], True
    for i in range(args.passes):
        results = {}
        for hybrid in ([True, False] if i % 2 == 0 else [False, True]):  # alternate which goes first
            llm = LLM(loaded=base.loaded, kv_cache_memory=f"{budget}B", max_model_len=request_tokens,
                      max_num_seqs=args.requests, max_num_batched_tokens=args.max_num_batched_tokens,
                      disable_hybrid_kv_cache_manager=not hybrid)
            results[hybrid] = run_burst(llm, prompts, args.output_tokens)
            del llm
        grouped, single = results[True], results[False]
        identical &= grouped.outputs == single.outputs
        ratios.append(grouped.output_tps / single.output_tps)
        for name, r in (("groups", grouped), ("one table", single)):
            print(f"pass {i + 1} {name:9}: holds {r.concurrency[0]:.2f} requests at once admitted, "
                  f"{r.concurrency[1]:.2f} decoding; {r.num_preemptions} "
                  f"preemptions, {r.seconds:.1f} s, {r.output_tps:.1f} output tok/s")
    median = statistics.median(ratios)
    print(f"output throughput, groups / one table: median {median:.2f}x, spread {min(ratios):.2f}-"
          f"{max(ratios):.2f}x over {args.passes} pass(es); greedy outputs identical: {identical}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
