"""Batch-1 decode of the embedded model as Q4_K_M (packed K-quants), Q4_0 and Q4_1 (packed legacy blocks) and Q4_K_M
dequantized at load (--quantization none), side by side in one run: decode steps of the engines alternate in
rounds (a shared machine's slow phases hit all alike); prints each one's median tok/s with its spread, and what
each holds in memory against its file's quantized tensors.

    .venv/bin/python benchmarks/kquant_decode.py                 # bf16 (auto dtype on AVX512_BF16 CPUs)
    .venv/bin/python benchmarks/kquant_decode.py --q4-k-m X.gguf # a Q4_K_M made by llama.cpp's llama-quantize
    .venv/bin/python benchmarks/kquant_decode.py --smoke         # a few steps: checks that it runs
    .venv/bin/python benchmarks/kquant_decode.py --table-mix     # also TABLE_MIX (IQ4_NL, MXFP4, Q5_1, Q5_K) packed

The Q4_K_M and Q4_0 files default to the embedded Q4_1 GGUF requantized in Python (tests/model/kquant_gguf.py:
llama.cpp's type mix, blocks rounded to nearest), cached under --cache-dir. The embedded model's rows of 576 are not
whole 256-value super-blocks, so its Q4_K_M is mostly Q5_0 (llama.cpp's fallback) with Q4_K / Q6_K ffn_down and a
Q8_0 head: bigger than its Q4_0 (~5.5 vs ~4.5 bits a weight in the layers).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from kvpilot import LLM, SamplingParams
from kvpilot.model.default_model import default_model_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/model/kquant_gguf.py writes the requantized files


def model_file(given: str | None, mix: str, cache_dir: Path) -> Path:
    """`given`, else the embedded model requantized to `mix` in cache_dir (made once, remade if the source is newer)."""
    if given:
        return Path(given)
    from tests.model.kquant_gguf import requantize

    source = default_model_path()
    target = cache_dir / f"{source.stem.split('.')[0]}.{mix}.gguf"
    if not target.is_file() or target.stat().st_mtime < source.stat().st_mtime:
        cache_dir.mkdir(parents=True, exist_ok=True)
        print(f"requantizing {source.name} to {mix}: {target}", flush=True)
        requantize(source, target, mix)
    return target


def start(path: Path, quantization: str, args: argparse.Namespace) -> LLM:
    """An engine whose one request has finished its prefill (every step from here is a batch-1 decode)."""
    max_tokens = (args.rounds + 1) * args.steps + 8
    llm = LLM(model=str(path), quantization=quantization, dtype=args.dtype,
              max_model_len=args.context + max_tokens + 16, max_num_seqs=1, kv_cache_memory=args.kv_cache_memory)
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(args.context)]
    llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while not llm.engine.step():  # the prefill's step returns the first token
        pass
    return llm


def step_seconds(llm: LLM, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - t0)
    return times


def report(name: str, times: list[float]) -> float:
    """Prints median tok/s and the spread (tok/s at the steps' 90th and 10th percentile times); returns the median."""
    ordered = sorted(times)
    median = statistics.median(ordered)
    fast, slow = ordered[len(ordered) // 10], ordered[(len(ordered) * 9) // 10]
    print(f"  {name:20s} {1 / median:7.1f} tok/s  (median step {median * 1e3:.2f} ms; p10-p90 "
          f"{1 / slow:.1f}-{1 / fast:.1f} tok/s; {len(times)} steps)")
    return 1 / median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--q4-k-m", help="a Q4_K_M GGUF of the embedded model (default: requantized in Python)")
    parser.add_argument("--q4-0", help="a Q4_0 GGUF of the embedded model (default: requantized in Python)")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvpilot" / "kquant-bench"))
    parser.add_argument("--quantization", default="auto", help="the packed engines' (auto or gguf)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8, help="alternations of the engines")
    parser.add_argument("--steps", type=int, default=32, help="decode steps of one engine per round")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--smoke", action="store_true", help="2 rounds of 3 steps")
    parser.add_argument("--table-mix", action="store_true",
                        help="also the embedded model as tests/model/kquant_gguf.py's TABLE_MIX, packed")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.context = 2, 3, 16
    cache = Path(args.cache_dir)
    q4km = model_file(args.q4_k_m, "Q4_K_M", cache)
    variants = {"Q4_K_M packed": (q4km, args.quantization),
                "Q4_0 packed": (model_file(args.q4_0, "Q4_0", cache), args.quantization),
                "Q4_1 packed": (default_model_path(), args.quantization),
                "Q4_K_M dequantized": (q4km, "none")}
    if args.table_mix:
        variants["TABLE_MIX packed"] = (model_file(None, "TABLE_MIX", cache), args.quantization)
    engines = {name: start(path, quantization, args) for name, (path, quantization) in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for llm in engines.values():
        step_seconds(llm, 2)  # warm-up
    for _ in range(args.rounds):
        for name, llm in engines.items():
            times[name] += step_seconds(llm, args.steps)
    first = next(iter(engines.values())).loaded
    print(f"embedded model, batch 1, context ~{args.context}, {first.dtype}, {torch.get_num_threads()} threads:")
    speeds = {name: report(name, times[name]) for name in engines}
    base = speeds["Q4_K_M packed"]
    others = (f"{name}: {base / speed:.2f}x" for name, speed in speeds.items() if name != "Q4_K_M packed")
    print("  Q4_K_M packed / " + ", ".join(others))
    for name, llm in engines.items():
        memory = llm.loaded.packed_memory
        print(f"  {name}: {memory.summary() if memory else 'dense weights'}")


if __name__ == "__main__":
    main()
