"""One decode row through a whole model's int8 tiles: the embedded model's layer shapes (30 x qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536) as random Q4_0, Q4_1 and Q8_0 tiled copies (quant/vnni_gemm.py), streamed from
memory as a batch-1 decode step streams them (the model's ~60-120 MB do not fit the cache), formats alternating in
rounds. Prints each format's median ms a pass, the bytes it read and the rate.

Q4_0's and Q8_0's tiles carry no offsets (derived from the scales) and Q4_1's do (its m): Q4_0 against Q4_1 is the
cost of the offsets' stream, 32 bytes a block of 288.

    .venv/bin/python benchmarks/tiled_matvec.py --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvpilot.model.quant.formats import Q4_0, Q4_1, Q8_0, QuantFormat
from kvpilot.model.quant.packed import PackedWeight
from kvpilot.model.quant.vnni_gemm import TiledWeight, tile

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in): qkv, o, gate_up, down
LAYERS = 30


def random_tiles(fmt: QuantFormat, rows: int, cols: int, rng: np.random.Generator) -> TiledWeight:
    """Random blocks of `fmt` with small finite scales (and minimums), tiled."""
    blocks = rng.integers(0, 256, size=(rows, cols // 32, fmt.block_bytes), dtype=np.uint8)
    halves = 2 if fmt == Q4_1 else 1  # d, and Q4_1's m
    for h in range(halves):
        blocks[:, :, 2 * h:2 * h + 2] = np.full(blocks.shape[:2], 0.01, np.float16).view(np.uint8).reshape(
            *blocks.shape[:2], 2)
    return tile(PackedWeight.from_blocks(blocks.reshape(rows, -1), fmt))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--passes", type=int, default=10, help="passes over the model a round and format")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    models = {fmt.name: [[random_tiles(fmt, n, k, rng) for n, k in SHAPES] for _ in range(LAYERS)]
              for fmt in (Q4_0, Q4_1, Q8_0)}
    inputs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}
    outputs = [torch.empty(1, n, dtype=torch.bfloat16) for n, _ in SHAPES]
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, layers in models.items():
            for _ in range(args.passes + 1):  # the first pass warms up
                start = time.perf_counter()
                for layer in layers:
                    for weight, out, (_, k) in zip(layer, outputs, SHAPES):
                        weight.matmul_into(out, inputs[k])
                times[name].append(time.perf_counter() - start)
            del times[name][-args.passes - 1]
    for name, layers in models.items():
        nbytes = sum(w.nbytes for layer in layers for w in layer)
        ms = statistics.median(times[name])
        print(f"{name}: {ms * 1e3:.3f} ms a pass ({min(times[name]) * 1e3:.3f}-{max(times[name]) * 1e3:.3f}), "
              f"{nbytes / 2**20:.1f} MiB, {nbytes / ms / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
