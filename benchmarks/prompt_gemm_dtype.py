"""Prompt-sized GEMMs of the embedded model in bf16 and in float32, side by side: does this CPU's bf16 pay?

A prompt chunk's linear layers run dense bf16 GEMMs (oneDNN's prepacked `mkldnn._linear_pointwise`, as
kvpilot's prompt path does) where the CPU has AVX512_BF16. On Zen 4 a bf16 dot product does twice the work of
a float32 FMA a cycle; on an Intel Xeon without AMX (family 6 model 207 in a VM, 2026-11-27) it does not, and
float32 GEMMs measured ~1.7x faster. This prints GFLOP/s per shape for: oneDNN prepacked bf16, torch bf16
`linear`, torch float32 `linear`, and the float32 / prepacked-bf16 ratio.

    .venv/bin/python benchmarks/prompt_gemm_dtype.py
    .venv/bin/python benchmarks/prompt_gemm_dtype.py --rows 512 2048 --reps 9

Shapes are SmolLM2-135M's (hidden 576, MLP 1,536, vocabulary 49,152); random values (timing does not depend
on them). Variants alternate within each round and the best round counts (the machine may be noisy).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def best_seconds(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    for run in runs.values():  # warm-up: first calls pick kernels and allocate
        run()
    best = {name: float("inf") for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def variants(rows: int, k: int, n: int) -> dict[str, Callable[[], object]]:
    x16, w16 = torch.randn(rows, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    x32, w32 = x16.float(), w16.float()
    runs: dict[str, Callable[[], object]] = {
        "bf16 linear": lambda: torch.nn.functional.linear(x16, w16),
        "fp32 linear": lambda: torch.nn.functional.linear(x32, w32),
    }
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        packed = torch.ops.mkldnn._reorder_linear_weight(w16.contiguous(), 1)
        runs["bf16 oneDNN"] = lambda: torch.ops.mkldnn._linear_pointwise(x16, packed, None, "none", [], "")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 2048], help="prompt tokens in the GEMM")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"# {torch.get_num_threads()} threads, torch {torch.__version__}; GFLOP/s, best of {args.reps} rounds")
    print(f"{'shape':<22} {'bf16 oneDNN':>12} {'bf16 linear':>12} {'fp32 linear':>12} {'fp32/oneDNN':>12}")
    with torch.inference_mode():
        for rows in args.rows:
            for name, (k, n) in SHAPES.items():
                seconds = best_seconds(variants(rows, k, n), args.reps)
                rate = {v: 2 * rows * k * n / s / 1e9 for v, s in seconds.items()}
                onednn = rate.get("bf16 oneDNN")
                ratio = f"{rate['fp32 linear'] / onednn:.2f}x" if onednn else "-"
                print(f"{name + f' {rows}x{k}x{n}':<22} {onednn or 0:12.0f} {rate['bf16 linear']:12.0f} "
                      f"{rate['fp32 linear']:12.0f} {ratio:>12}")


if __name__ == "__main__":
    main()
