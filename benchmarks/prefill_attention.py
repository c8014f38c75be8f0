"""Prefill attention on CPU, side by side: the C++ bf16 kernel (layers/cpu_prefill_kernel.py, AVX512_BF16) vs
torch's scaled_dot_product_attention (causal, GQA) on the same bf16 prompt, per layer; prints ms, GFLOP/s
(causal: half the score matrix) and the ratio.

    .venv/bin/python benchmarks/prefill_attention.py                       # SmolLM2's heads: 9 query, 3 KV, dim 64
    .venv/bin/python benchmarks/prefill_attention.py --lengths 512 --heads 32 --kv-heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import kvpilot.model.attention  # noqa: F401 - before layers.paged_attention, which imports attention's metadata
from kvpilot.model.layers.cpu_prefill_kernel import get_prefill_kernel
from kvpilot.model.layers.paged_attention import write_kv

BLOCK = 16


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of `reps` calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(kernel, length: int, heads: int, kv_heads: int, dim: int, reps: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(length)
    num_blocks = -(-length // BLOCK)
    cache = torch.zeros(2, kv_heads, num_blocks, BLOCK, dim, dtype=torch.bfloat16)
    q, k, v = (torch.randn(length, h, dim, generator=g).to(torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    write_kv(cache, k, v, torch.arange(length))
    block_ids = torch.arange(num_blocks)
    out = torch.empty_like(q)
    scale = dim ** -0.5
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    kernel_s = timed(lambda: kernel.prefill_attention_bf16(out, q, cache[0], cache[1], block_ids, 0, scale), reps)
    sdpa_s = timed(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True),
                   reps)
    return kernel_s, sdpa_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    kernel = get_prefill_kernel()
    if kernel is None:
        raise SystemExit("the prefill attention kernel does not run here (it needs AVX512_BF16 and a C++ compiler)")
    print(f"# {torch.get_num_threads()} threads; {args.heads} query heads, {args.kv_heads} KV heads, dim "
          f"{args.head_dim}, bf16; median of {args.reps}")
    for length in args.lengths:
        kernel_s, sdpa_s = measure(kernel, length, args.heads, args.kv_heads, args.head_dim, args.reps)
        flops = 2 * 2 * length * length * args.head_dim * args.heads / 2
        print(f"{length:5d} tokens: kernel {kernel_s * 1e3:7.3f} ms ({flops / kernel_s / 1e9:4.0f} GFLOP/s), "
              f"sdpa {sdpa_s * 1e3:7.3f} ms ({flops / sdpa_s / 1e9:4.0f} GFLOP/s): {sdpa_s / kernel_s:.2f}x")


if __name__ == "__main__":
    main()
