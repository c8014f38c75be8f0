"""The CPU paged decode-attention kernel alone (layers/csrc/paged_decode_cpu.cpp), against this machine's memory
read bandwidth: B sequences x context C, SmolLM2's heads (9 query, 3 KV, dim 64), a bf16 KV cache per layer for
30 layers (so the K/V streamed per step is what the embedded model's decode step streams, far more than the
CPU's caches), with block tables three ways: blocks at random places, consecutive blocks, and one layer's cache
read 30 times (from cache). Prints ms per 30 layers, GB/s of K/V read, and the ratio to a plain read of memory.

    .venv/bin/python benchmarks/cpu_decode_attention.py
    .venv/bin/python benchmarks/cpu_decode_attention.py --batch 16 --context 1000 --threads 1 2
    .venv/bin/python benchmarks/cpu_decode_attention.py --block-size 16 64 128
"""

from __future__ import annotations

import argparse
import time

import torch

from kvpilot.model.layers.cpu_decode_kernel import get_kernel

NUM_LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def read_bandwidth(num_bytes: int = 512 * 2**20) -> float:
    """GB/s of torch summing a bf16 tensor far larger than the caches: the memory roof of a streaming kernel."""
    x = torch.ones(num_bytes // 2, dtype=torch.bfloat16)
    x.sum()
    start = time.perf_counter()
    for _ in range(5):
        x.sum()
    return num_bytes * 5 / (time.perf_counter() - start) / 1e9


def time_layers(kernel, caches, tables, lens, q, out, reps: int) -> float:  # noqa: ANN001 - a compiled module
    for kc, vc in caches:
        kernel.paged_decode(out, q, kc, vc, tables, lens, HEAD_DIM ** -0.5)
    start = time.perf_counter()
    for _ in range(reps):
        for kc, vc in caches:
            kernel.paged_decode(out, q, kc, vc, tables, lens, HEAD_DIM ** -0.5)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--block-size", type=int, nargs="+", default=[16], help="KV block sizes (tokens) to compare")
    args = parser.parse_args()
    kernel = get_kernel()
    if kernel is None:
        raise SystemExit("the CPU decode kernel could not be built here (no C++ compiler?)")
    print(f"# batch {args.batch}, context {args.context}: "
          f"{NUM_LAYERS * args.batch * args.context * KV_HEADS * HEAD_DIM * 4 / 1e6:.0f} MB of bf16 K/V per 30 layers")
    for block_size in args.block_size:
        for threads in args.threads:
            torch.set_num_threads(threads)
            time_block_size(kernel, args, block_size, threads)


def time_block_size(kernel, args: argparse.Namespace, block_size: int, threads: int) -> None:  # noqa: ANN001
    """Prints the three block placements' times for one block size and thread count."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-args.context // block_size)
    num_blocks = args.batch * blocks_per_seq
    caches = [tuple(torch.randn(KV_HEADS, num_blocks, block_size, HEAD_DIM, generator=gen).to(torch.bfloat16)
                    for _ in range(2)) for _ in range(NUM_LAYERS)]
    layouts = {"random blocks": torch.randperm(num_blocks, generator=gen).view(args.batch, blocks_per_seq),
               "consecutive blocks": torch.arange(num_blocks).view(args.batch, blocks_per_seq)}
    lens = torch.full((args.batch,), args.context, dtype=torch.long)
    q, out = torch.randn(args.batch, HEADS, HEAD_DIM, generator=gen), torch.empty(args.batch, HEADS, HEAD_DIM)
    kv_bytes = NUM_LAYERS * args.batch * args.context * KV_HEADS * HEAD_DIM * 2 * 2
    roof = read_bandwidth()
    runs = [(name, caches, table) for name, table in layouts.items()]
    runs.append(("one layer x30 (cached)", [caches[0]] * NUM_LAYERS, layouts["random blocks"]))
    for name, layer_caches, table in runs:
        seconds = time_layers(kernel, layer_caches, table.long(), lens, q, out, args.reps)
        rate = kv_bytes / seconds / 1e9
        print(f"blocks of {block_size}, {threads} threads, {name:24s}: {seconds * 1e3:7.2f} ms, {rate:5.1f} GB/s = "
              f"{rate / roof:.2f}x the {roof:.1f} GB/s memory read")

if __name__ == "__main__":
    main()
