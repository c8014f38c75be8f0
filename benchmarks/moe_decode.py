"""Mixture-of-experts decode against its dense equivalent, side by side in one run: Qwen3-30B-A3B's layer shapes
(128 experts of width 768, top-8, hidden 2048, 32 query / 4 KV heads of 128) at a few layers, with dummy weights,
next to the same model with one dense MLP of the routed experts' total width (8 x 768 = 6,144): equal *active*
parameters (the dense one lacks only the router, 0.26M a layer). Decode steps of the two alternate in rounds (a
shared machine's slow phases hit both alike); prints each one's median tok/s with its spread and the ratio.

    .venv/bin/python benchmarks/moe_decode.py                         # CPU, batch 1, 4 layers, bf16
    .venv/bin/python benchmarks/moe_decode.py --device cuda --batch 64
    .venv/bin/python benchmarks/moe_decode.py --smoke                 # a few steps: checks that it runs

The issue's goal: MoE decode at batch 1 >= 0.7x the dense equivalent (both read about the same weight bytes a
token: the top-k experts' against the dense MLP's). The vocabulary defaults to 32k, not Qwen's 152k, so that the
output layer (the same in both) does not hide the layers' difference; --vocab-size 151936 for the real one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvpilot import LLM, SamplingParams
from kvpilot.fit.model_catalog import get_hf_config


def configs(layers: int, vocab: int) -> dict[str, dict]:
    """The MoE config and its dense equivalent (equal active parameters)."""
    moe = {**get_hf_config("qwen3-30b-a3b"), "num_hidden_layers": layers, "vocab_size": vocab,
           "bos_token_id": 1, "eos_token_id": 2}
    dense = {**get_hf_config("qwen3-8b"), **{k: moe[k] for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
        "vocab_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id")},
        "intermediate_size": moe["num_experts_per_tok"] * moe["moe_intermediate_size"]}
    return {"moe": moe, "dense": dense}


def start(config: dict, directory: Path, args: argparse.Namespace) -> LLM:
    """An engine on dummy weights whose `batch` requests have finished their prefill (all decode from here)."""
    (directory / "config.json").write_text(json.dumps(config))
    max_tokens = args.rounds * args.steps + 8
    llm = LLM(model=str(directory), load_format="dummy", dtype=args.dtype, device=args.device,
              max_model_len=args.context + max_tokens + 16, max_num_seqs=args.batch,
              kv_cache_memory=args.kv_cache_memory)
    rng = random.Random(0)
    for _ in range(args.batch):
        prompt = [rng.randrange(100, config["vocab_size"]) for _ in range(args.context)]
        llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    produced: set[str] = set()
    while len(produced) < args.batch:  # a request's first output ends its prefill
        produced.update(o.request_id for o in llm.engine.step())
    return llm


def step_seconds(llm: LLM, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def report(name: str, times: list[float], batch: int) -> float:
    """Prints median tok/s and the spread (tok/s at the steps' 10th and 90th percentiles); returns the median."""
    ordered = sorted(times)
    median = statistics.median(ordered)
    fast, slow = ordered[len(ordered) // 10], ordered[(len(ordered) * 9) // 10]
    print(f"  {name:6s} {batch / median:8.1f} tok/s  (median step {median * 1e3:.2f} ms; p10-p90 "
          f"{batch / slow:.1f}-{batch / fast:.1f} tok/s; {len(times)} steps)")
    return batch / median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8, help="alternations of the two models")
    parser.add_argument("--steps", type=int, default=16, help="decode steps of one model per round")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--smoke", action="store_true", help="2 layers, 2 rounds of 3 steps")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.rounds, args.steps, args.context = 2, 2, 3, 16
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for name, config in configs(args.layers, args.vocab_size).items():
            (Path(tmp) / name).mkdir()
            engines[name] = start(config, Path(tmp) / name, args)
            times[name] = []
        for name, llm in engines.items():
            step_seconds(llm, 2)  # warm-up
        for _ in range(args.rounds):
            for name, llm in engines.items():
                times[name] += step_seconds(llm, args.steps)
        loaded = engines["moe"].loaded
    print(f"Qwen3-30B-A3B layer shapes x {args.layers} layers, vocab {args.vocab_size}, batch {args.batch}, "
          f"context ~{args.context}, {loaded.dtype}, {loaded.device}, {torch.get_num_threads()} threads:")
    moe, dense = (report(name, times[name], args.batch) for name in ("moe", "dense"))
    print(f"  MoE / dense-equivalent: {moe / dense:.2f}x (goal >= 0.70x at batch 1)")


if __name__ == "__main__":
    main()
