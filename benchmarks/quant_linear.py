"""Packed GGUF weights vs dequantized dense weights on CPU, side by side in one run.

Part 1 (`--part kernel`): all linear layers of one forward step of the embedded model (30 layers x qkv, o,
gate_up, down + the Q8_0 output layer, the model's own weights) for R rows, timed as
  packed-kernel   the fused C++ kernel (float32 activations) on the packed Q4_1 / Q8_0 blocks
  packed-deq-bf16 dequantize each layer into a scratch matrix (bf16) + torch GEMM (the many-row path)
  packed-deq-fp32 the same in float32
  dense-bf16      torch F.linear on bf16 weights (the `--quantization none --dtype bfloat16` model)
  dense-fp32      torch F.linear on float32 weights
Part 2 (`--part decode`): single-stream decode tok/s of the embedded model through the offline LLM API,
packed (float32 and bfloat16 activations) vs dequantized bf16 by default, alternating engine by engine.

    .venv/bin/python benchmarks/quant_linear.py --rows 1 4 16 64 512 --reps 5
    .venv/bin/python benchmarks/quant_linear.py --part decode --tokens 64 --rounds 2
    .venv/bin/python benchmarks/quant_linear.py --part vnni --rows 1 4 8   # the int8-activation experiment

The machine may be shared and noisy: compare the ratios printed in one run, not absolute numbers.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvpilot import LLM, SamplingParams
from kvpilot.model.loader import load_model
from kvpilot.model.quant.kernel import ISA_NAMES, best_isa
from kvpilot.model.quant.linear import PackedLinear


def packed_layers(model: torch.nn.Module) -> list[PackedLinear]:
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    return layers


def dense_copy(layer: PackedLinear, dtype: torch.dtype) -> torch.Tensor:
    """The layer's weights as a dense [out, in] view of a contiguous [in, out] tensor (weight_layout.py)."""
    weight = torch.cat([p.dequantize(torch.float32) for p in layer.parts]).to(dtype)
    return weight.t().contiguous().t()


def time_interleaved(runs: list[Callable[[], None]], reps: int) -> list[float]:
    """Seconds per run: the minimum over `reps` rounds that each time every run once (noise from other
    processes then hits all variants alike, and the minimum is the least disturbed pass)."""
    for run in runs:
        run()  # warm-up (scratch allocation, thread pool)
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for run, seen in zip(runs, times):
            start = time.perf_counter()
            run()
            seen.append(time.perf_counter() - start)
    return [min(seen) for seen in times]


@torch.inference_mode()
def kernel_part(rows_list: list[int], reps: int) -> None:
    loaded = load_model(None, dtype="float32", quantization="gguf", max_model_len=64)
    layers = packed_layers(loaded.model)
    dense = {dt: [dense_copy(layer, dt) for layer in layers] for dt in (torch.bfloat16, torch.float32)}
    packed_mb = sum(layer.nbytes for layer in layers) / 1e6
    print(f"{len(layers)} linear layers per step; packed {packed_mb:.0f} MB, bf16 "
          f"{sum(w.numel() * 2 for w in dense[torch.bfloat16]) / 1e6:.0f} MB; kernel ISA {ISA_NAMES[best_isa()]}; "
          f"{torch.get_num_threads()} threads")
    header = ["rows", "packed-kernel", "packed-deq-bf16", "packed-deq-fp32", "dense-bf16", "dense-fp32"]
    print("ms per step (min of %d interleaved rounds)" % reps)
    print("  ".join(f"{h:>15}" for h in header) + "   kernel speed-up vs dense-bf16 / dense-fp32")
    for rows in rows_list:
        x32 = torch.randn(rows, 576)
        xs = {dt: x32.to(dt) for dt in dense}

        def kernel_run() -> None:
            for layer in layers:
                layer._kernel_rows(_input(layer, xs[torch.float32]), torch.float32)

        def deq_run(dt: torch.dtype) -> Callable[[], None]:
            return lambda: [F.linear(_input(layer, xs[dt]), layer._dense(dt)) for layer in layers] and None

        def dense_run(dt: torch.dtype) -> Callable[[], None]:
            return lambda: [F.linear(_input(layer, xs[dt]), w) for layer, w in zip(layers, dense[dt])] and None

        runs = [kernel_run, deq_run(torch.bfloat16), deq_run(torch.float32), dense_run(torch.bfloat16),
                dense_run(torch.float32)]
        ms = [t * 1e3 for t in time_interleaved(runs, reps)]
        print("  ".join(f"{v:>15.2f}" for v in [rows, *ms]) + f"   {ms[3] / ms[0]:.2f}x / {ms[4] / ms[0]:.2f}x")


@torch.inference_mode()
def vnni_part(rows_list: list[int], reps: int) -> None:
    """The float32 kernel vs int8 activations (VNNI dot products, or AVX2's vpmaddubsw for the tiled copy): the 120
    Q4_1 layers, then the Q8_0 output layer (49,152 x 576, the tied embedding table) on its own."""
    from kvpilot.model.quant.kernel import get_quant_kernel

    kernel = get_quant_kernel()
    loaded = load_model(None, dtype="float32", quantization="gguf", max_model_len=64)
    every = packed_layers(loaded.model)
    for name in ("Q4_1", "Q8_0"):
        layers = [m for m in every if m.parts[0].format.name == name]
        print(f"{len(layers)} {name} layers; ms per step (min of {reps} interleaved rounds)")
        _vnni_rows(kernel, layers, rows_list, reps)


def _vnni_rows(kernel, layers: list[PackedLinear], rows_list: list[int], reps: int) -> None:
    """The float32 kernel, the int8 path on the interleaved copy (VNNI only) and on the column-tiled copy, and
    torch's dense bf16 GEMM (the hybrid layout's many-row path), side by side."""
    from kvpilot.model.quant.kernel import has_vnni
    from kvpilot.model.quant.vnni_gemm import can_tile, tile
    from kvpilot.model.quant.vnni_layout import interleave

    interleaved = [interleave(layer.parts[0]) if has_vnni() else None for layer in layers]
    tiled = [tile(layer.parts[0]) if can_tile(layer.parts[0]) else None for layer in layers]
    dense = [layer.parts[0].dequantize(torch.bfloat16, layer.isa) for layer in layers]
    try:  # oneDNN's blocked layout (its bf16 path needs AVX-512 or AVX-NE-CONVERT)
        prepacked = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in dense]
    except RuntimeError:
        prepacked = []
    for rows in rows_list:
        x = torch.randn(rows, 576)
        outs = [torch.empty(rows, layer.out_features) for layer in layers]
        bf16_outs = [torch.empty(rows, layer.out_features, dtype=torch.bfloat16) for layer in layers]

        def fp32_run() -> None:
            for layer, out in zip(layers, outs):
                layer.parts[0].matmul_into(out, _input(layer, x), layer.isa)

        def interleaved_run() -> None:
            for layer, v, out in zip(layers, interleaved, outs):
                if v is not None:
                    kernel.quant_matmul_interleaved(out, _input(layer, x), v.vq, v.vd, v.vo, v.q8)

        def tiled_run() -> None:
            for layer, v, out in zip(layers, tiled, bf16_outs):
                if v is not None:
                    v.matmul_into(out, _input(layer, x.to(torch.bfloat16)))

        def dense_run() -> None:
            for layer, w, out in zip(layers, dense, bf16_outs):
                torch.mm(_input(layer, x.to(torch.bfloat16)), w.t(), out=out)

        def prepacked_run() -> None:
            for layer, w in zip(layers, prepacked):
                torch.ops.mkldnn._linear_pointwise(_input(layer, x.to(torch.bfloat16)), w, None, "none", [], "")

        fp32_s, vnni_s, tiled_s, dense_s, prepacked_s = time_interleaved(
            [fp32_run, interleaved_run, tiled_run, dense_run, prepacked_run], reps)
        tiled_note = f", tiled {tiled_s * 1e3:.2f} ms" if any(v is not None for v in tiled) else ""
        interleaved_note = f"{vnni_s * 1e3:.2f} ms ({fp32_s / vnni_s:.2f}x)" if has_vnni() else "- (needs VNNI)"
        print(f"rows {rows:>3}: float32 dequantize + FMA {fp32_s * 1e3:.2f} ms, int8 activations: interleaved "
              f"{interleaved_note}{tiled_note}; dense bf16 GEMM {dense_s * 1e3:.2f} ms, "
              f"prepacked {f'{prepacked_s * 1e3:.2f} ms' if prepacked else '-'}")


_INPUTS: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}


def _input(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """An input of the layer's width with x's rows (down_proj takes 1536 columns)."""
    if layer.in_features == x.shape[1]:
        return x
    key = (x.shape[0], layer.in_features, x.dtype)
    if key not in _INPUTS:
        _INPUTS[key] = torch.randn(x.shape[0], layer.in_features).to(x.dtype)
    return _INPUTS[key]


DECODE_VARIANTS = {"packed-fp32": ("float32", "gguf"), "packed-bf16": ("bfloat16", "gguf"),
                   "hybrid-bf16": ("bfloat16", "auto"),  # packed for few rows, resident dense bf16 for more
                   "dense-bf16": ("bfloat16", "none"), "dense-fp32": ("float32", "none")}


def decode_part(tokens: int, rounds: int, variants: list[str]) -> None:
    engines = {name: LLM(dtype=DECODE_VARIANTS[name][0], quantization=DECODE_VARIANTS[name][1], max_model_len=256,
                         max_num_seqs=4, kv_cache_memory="64MiB") for name in variants}
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompt = [[1, 504, 3458, 282, 4649, 314]]
    results: dict[str, list[float]] = {name: [] for name in engines}
    for name, llm in engines.items():
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    for _ in range(rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate(prompt, params)
            results[name].append(tokens / (time.perf_counter() - start))
    base = variants[-1]
    for name, values in results.items():
        ratio = max(values) / max(results[base])
        print(f"{name:>12}: single-stream decode {max(values):.1f} tok/s (best of runs "
              f"{', '.join(f'{v:.1f}' for v in values)}); {ratio:.2f}x {base}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("kernel", "decode", "both", "vnni"), default="both")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=list(DECODE_VARIANTS),
                        default=["packed-fp32", "packed-bf16", "dense-bf16"],
                        help="decode part: engines to compare, alternating; ratios are against the last")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part == "vnni":
        vnni_part(args.rows, args.reps)
    if args.part in ("kernel", "both"):
        kernel_part(args.rows, args.reps)
    if args.part in ("decode", "both"):
        decode_part(args.tokens, args.rounds, args.variants)


if __name__ == "__main__":
    main()
