"""Time of one batched sampling call (kvpilot.model.sampler.sample) on [N, vocab] float32 logits, for the
sampling settings users send most: the OpenAI defaults (temperature 1, no filters), top-p, top-k, min-p, and
a batch mixing seeded and unseeded rows. Compare versions side by side by running it twice in one session
with PYTHONPATH pointing at each checkout's src/:

    .venv/bin/python benchmarks/sampling.py --rows 64 --vocab 49152
    PYTHONPATH=/tmp/kvpilot-old/src .venv/bin/python benchmarks/sampling.py --rows 64 --vocab 49152
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpilot.model.sampler import SamplingBatch, sample
from kvpilot.sampling_params import SamplingParams

CASES = {
    "defaults (t=1)": lambda i: SamplingParams(temperature=1.0),
    "top_p 0.9": lambda i: SamplingParams(temperature=0.8, top_p=0.9),
    "top_k 50": lambda i: SamplingParams(temperature=0.8, top_k=50),
    "min_p 0.05": lambda i: SamplingParams(temperature=0.8, min_p=0.05),
    "half seeded": lambda i: SamplingParams(temperature=1.0, seed=i if i % 2 else None),
    "greedy": lambda i: SamplingParams(temperature=0.0),
}


def time_case(make, rows: int, vocab: int, repeats: int) -> float:
    logits = torch.randn(rows, vocab) * 4
    params = [make(i) for i in range(rows)]
    times = []
    for _ in range(repeats + 1):
        generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        batch = SamplingBatch.build(params, generators, vocab, torch.device("cpu"))
        start = time.perf_counter()
        sample(logits, batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"# sample() on [{args.rows}, {args.vocab}] float32, {torch.get_num_threads()} threads; median ms")
    for name, make in CASES.items():
        print(f"{name:16s} {time_case(make, args.rows, args.vocab, args.repeats) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
