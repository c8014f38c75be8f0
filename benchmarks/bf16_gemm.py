"""Dense bf16 GEMMs of decode-sized calls on CPU, side by side in one run: kvpilot's AVX512_BF16 kernel
(layers/bf16_linear.py) against oneDNN on its prepacked copy (onednn_linear.py), F.linear on the plain weight and,
on AMX CPUs, the copy packed for tiles (layers/amx_tiles.py).

Part `projections`: the embedded model's four projection shapes x 30 layers (random bf16 weights, ~212 MB: far
larger than the caches, as in a decode step) and its tied output layer (49,152 x 576), for each row count; the
median of `--reps` passes, each engine in turn. Part `steps`: decode steps of the dense bf16 model (`--quantization
none`) with Bf16Linear against the same model with OneDnnLinear, alternating step by step on the same requests.
Part `head`: the output layer's float32 logits (an AMX CPU's paths): the kernel's float32 sums, oneDNN's bf16 math
mode on a float32 copy, and the copy packed for AMX tiles (layers/amx_tiles.py) where the kernels can use them.

    .venv/bin/python benchmarks/bf16_gemm.py --rows 1 16 64 128
    .venv/bin/python benchmarks/bf16_gemm.py --part steps --batch 1 16 64
    .venv/bin/python benchmarks/bf16_gemm.py --part head --rows 1 4 8 16 32 64 128

Needs AVX512_BF16 (the kernel's CPUs). The machine may be shared: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvpilot import LLM, SamplingParams
from kvpilot.model.layers import onednn_linear
from kvpilot.model.layers.amx_tiles import AmxTileWeight, amx_tiles_kernel
from kvpilot.model.layers.bf16_linear import bf16_gemm_kernel, bf16_math_linear
from kvpilot.model.layers.onednn_linear import OneDnnWeight

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down of SmolLM2-135M
NUM_LAYERS = 30
VOCAB = 49_152


def _median_seconds(run: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def projections_part(rows_list: list[int], reps: int) -> None:
    kernel = bf16_gemm_kernel(torch.bfloat16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    layers = [[torch.randn(n, k, generator=gen).to(torch.bfloat16) for n, k in SHAPES] for _ in range(NUM_LAYERS)]
    packed = [[OneDnnWeight(w) for w in layer] for layer in layers]
    tiles = [[AmxTileWeight(w, kernel) for w in layer] for layer in layers] \
        if amx_tiles_kernel(kernel, layers[0][0]) else None
    head = torch.randn(VOCAB, 576, generator=gen).to(torch.bfloat16)
    flops = 2 * sum(w.numel() for layer in layers for w in layer)

    def mine(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
        kernel.bf16_linear(out, x, w, None)
        return out

    print(f"{NUM_LAYERS} layers x {len(SHAPES)} projections ({flops / 2**20:.0f} MiB of bf16 weights) and "
          f"the {VOCAB} x 576 output layer; ms, median of {reps}, {torch.get_num_threads()} threads")
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}
        ours = _median_seconds(lambda: [mine(xs[w.shape[1]], w) for layer in layers for w in layer], reps)
        onednn = _median_seconds(lambda: [p.linear(xs[p.in_features]) for layer in packed for p in layer], reps)
        plain = _median_seconds(lambda: [F.linear(xs[w.shape[1]], w) for layer in layers for w in layer], reps)
        on_tiles = _median_seconds(lambda: [t.linear(xs[t.in_features]) for layer in tiles for t in layer], reps) \
            if tiles else None
        head_ours = _median_seconds(lambda: kernel.bf16_linear(torch.empty(rows, VOCAB), xs[576], head, None), reps)
        head_plain = _median_seconds(lambda: F.linear(xs[576], head).float(), reps)
        print(f"rows {rows:4d}: projections kernel {ours * 1e3:7.2f} ({rows * flops / ours / 1e9:4.0f} GFLOP/s), "
              f"oneDNN prepacked {onednn * 1e3:7.2f}, F.linear {plain * 1e3:7.2f}"
              f"{f', AMX tiles {on_tiles * 1e3:7.2f}' if on_tiles else ''} | output layer kernel "
              f"{head_ours * 1e3:6.2f}, F.linear {head_plain * 1e3:6.2f} | kernel vs best other "
              f"{min(onednn, plain) / ours:.2f}x")


def head_part(rows_list: list[int], reps: int) -> None:
    kernel = bf16_gemm_kernel(torch.bfloat16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(VOCAB, 576, generator=gen).to(torch.bfloat16)
    float32_copy = head.float()
    tiles = AmxTileWeight(head, amx_tiles_kernel(kernel, head)) if amx_tiles_kernel(kernel, head) else None
    print(f"the {VOCAB} x 576 output layer, float32 logits; ms, median of {reps}, {torch.get_num_threads()} threads"
          f"{'' if tiles else ' (no AMX tiles here)'}")
    for rows in rows_list:
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        by_kernel = _median_seconds(lambda: kernel.bf16_linear(torch.empty(rows, VOCAB), x, head, None), reps)
        by_copy = _median_seconds(lambda: bf16_math_linear(x.float(), float32_copy, None), reps)
        by_tiles = _median_seconds(lambda: tiles.linear(x, None, torch.float32), reps) if tiles else None
        print(f"rows {rows:4d}: kernel {by_kernel * 1e3:6.2f}, float32 copy (bf16 math) {by_copy * 1e3:6.2f}"
              + (f", AMX tiles {by_tiles * 1e3:6.2f} ({min(by_kernel, by_copy) / by_tiles:.2f}x the best other)"
                 if by_tiles else ""))


def _dense_llm(with_kernel: bool, max_num_seqs: int) -> LLM:
    """The dense bf16 model; without the kernel, as a CPU without AVX512_BF16 holds it (OneDnnLinear)."""
    original = onednn_linear.bf16_gemm_kernel
    if not with_kernel:
        onednn_linear.bf16_gemm_kernel = lambda *args: None
    try:
        return LLM(dtype="bfloat16", quantization="none", max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    finally:
        onednn_linear.bf16_gemm_kernel = original


def steps_part(batches: list[int], context: int, steps: int) -> None:
    for batch in batches:
        engines = {"kernel": _dense_llm(True, max(batch, 1)), "oneDNN": _dense_llm(False, max(batch, 1))}
        times: dict[str, list[float]] = {name: [] for name in engines}
        for name, llm in engines.items():
            rng = random.Random(batch)
            for _ in range(batch):
                prompt = [rng.randrange(100, 40_000) for _ in range(context)]
                llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
            for _ in range(4):  # the prefill and a few decode steps
                llm.engine.step()
        for _ in range(steps):
            for name, llm in engines.items():
                start = time.perf_counter()
                llm.engine.step()
                times[name].append(time.perf_counter() - start)
        kernel, onednn = (statistics.median(times[name]) for name in ("kernel", "oneDNN"))
        print(f"decode step, batch {batch}, context ~{context}: kernel {kernel * 1e3:.2f} ms, oneDNN "
              f"{onednn * 1e3:.2f} ms ({onednn / kernel:.2f}x; medians of {steps} alternating steps)")
        del engines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("projections", "steps", "head", "both"), default="both")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if bf16_gemm_kernel(torch.bfloat16, torch.device("cpu")) is None:
        raise SystemExit("this CPU has no AVX512_BF16 (or the C++ kernels cannot be built): nothing to compare")
    if args.part in ("projections", "both"):
        projections_part(args.rows, args.reps)
    if args.part in ("steps", "both"):
        steps_part(args.batch, args.context, args.steps)
    if args.part == "head":
        head_part(args.rows, args.reps)


if __name__ == "__main__":
    main()
