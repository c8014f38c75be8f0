"""The linear layers of one mixed step (decode rows beside prompt rows) on the embedded model, bf16 auto, three
ways side by side: every row on the dense bf16 GEMM (what a step with prompt tokens does: the Int8Gate is
closed), the decode rows on the tiled int8 path and the prompt rows dense (a split), and every row on the int8
path (what a decode-only step does). Plus the output layer for the sampled rows (the decodes and one prompt's
last token), dense or split.

    .venv/bin/python benchmarks/mixed_step_gemms.py
    .venv/bin/python benchmarks/mixed_step_gemms.py --shapes 16x128 64x128 --reps 7

Random bf16 activations (the timing does not depend on the values). The machine may be noisy: each variant
runs once per round, rounds alternate, and the minimum over rounds is printed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvpilot import LLM
from kvpilot.model.quant.linear import Int8Gate, PackedLinear


def min_times(runs: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """ms per variant: the minimum over `reps` rounds, each running every variant once (after one warm-up)."""
    for run in runs.values():
        run()
    seen: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seen[name].append(time.perf_counter() - start)
    return {name: min(times) * 1e3 for name, times in seen.items()}


def layer_variants(layers: list[PackedLinear], gate: Int8Gate, num_decodes: int,
                   num_prompt: int) -> dict[str, Callable[[], None]]:
    xs = {layer.in_features: torch.randn(num_decodes + num_prompt, layer.in_features).to(torch.bfloat16)
          for layer in layers}

    def run(split_at: int | None) -> None:  # None: every row dense; else rows [:split_at] int8, the rest dense
        for layer in layers:
            x = xs[layer.in_features]
            if split_at is None:
                gate.open = False
                layer(x)
                continue
            gate.open = True
            layer(x[:split_at])
            gate.open = False
            if split_at < x.shape[0]:
                layer(x[split_at:])

    total = num_decodes + num_prompt
    return {"dense": lambda: run(None), "split": lambda: run(num_decodes), "all int8": lambda: run(total)}


def head_variants(head: PackedLinear, gate: Int8Gate, num_decodes: int) -> dict[str, Callable[[], None]]:
    x = torch.randn(num_decodes + 1, head.in_features).to(torch.bfloat16)

    def dense() -> None:
        gate.open = False
        head.forward_float32(x)

    def split() -> None:
        gate.open = True
        head.forward_float32(x[:num_decodes])
        gate.open = False
        head.forward_float32(x[num_decodes:])

    return {"dense": dense, "split": split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["4x128", "16x16", "16x128", "64x64", "64x128", "64x512"],
                        help="DECODESxPROMPT_TOKENS rows of a step (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    llm = LLM(max_model_len=1024)
    model = llm.engine.runner.model
    gate, head = model.int8_gate, model.output_head
    if gate is None or not isinstance(head, PackedLinear):
        raise SystemExit("no int8 path on this machine (it needs bf16 activations and AVX-512 VNNI)")
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m is not head]
    print(f"# {torch.get_num_threads()} threads; {len(layers)} packed layers + the output layer; ms, min of "
          f"{args.reps} rounds")
    print("| decodes + prompt rows | layers: dense | split | all int8 | head: dense | split |")
    print("|---|---:|---:|---:|---:|---:|")
    for shape in args.shapes:
        num_decodes, num_prompt = (int(v) for v in shape.split("x"))
        lay = min_times(layer_variants(layers, gate, num_decodes, num_prompt), args.reps)
        hd = min_times(head_variants(head, gate, num_decodes), args.reps + 1)
        print(f"| {num_decodes} + {num_prompt} | {lay['dense']:.1f} | {lay['split']:.1f} | {lay['all int8']:.1f} | "
              f"{hd['dense']:.2f} | {hd['split']:.2f} |")
    gate.open = True


if __name__ == "__main__":
    main()
