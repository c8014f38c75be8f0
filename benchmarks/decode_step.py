"""Decode-step profile: B requests of prompt length L decoding together on the embedded model; prints the
mean step time (ms), tokens/s, and the top operators by self CPU time (torch.profiler).

    .venv/bin/python benchmarks/decode_step.py --batch 64 --context 300 --steps 10

This is the micro-benchmark behind engine speed changes: the offline throughput's decode phase is these steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvpilot import LLM, SamplingParams


def fill_to_decode(llm: LLM, batch: int, context: int, max_tokens: int, seed: int) -> None:
    """Adds `batch` requests and steps until every one has finished its prefill (all now decode)."""
    rng = random.Random(seed)
    vocab = llm.loaded.config.vocab_size
    for _ in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(context)]
        llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    produced: set[str] = set()
    while len(produced) < batch:
        produced.update(o.request_id for o in llm.engine.step())


def timed_steps(llm: LLM, steps: int) -> list[float]:
    """Seconds of each step (a shared VM's noise comes in bursts: the median and min are steadier than a mean)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", default="6GiB",
                        help="Enough for batch x (context + steps) tokens, or preemptions distort the steps.")
    parser.add_argument("--quantization", default="auto", help="auto | gguf (packed) | none (dense)")
    parser.add_argument("--profile", action="store_true", help="Also print the top operators.")
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype, max_model_len=args.context + 4 * args.steps + 16, max_num_seqs=args.batch,
              kv_cache_memory=args.kv_cache_memory, quantization=args.quantization)
    fill_to_decode(llm, args.batch, args.context, max_tokens=4 * args.steps + 16, seed=0)
    timed_steps(llm, 2)  # warm-up
    times = timed_steps(llm, args.steps)
    step_s = statistics.median(times)
    print(f"decode step: batch {args.batch}, context ~{args.context}: {step_s * 1e3:.1f} ms "
          f"= {args.batch / step_s:.1f} tok/s (median of {args.steps}; min {min(times) * 1e3:.1f} ms; "
          f"{torch.get_num_threads()} threads, {args.dtype}, quantization {args.quantization})")
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            timed_steps(llm, args.steps)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
