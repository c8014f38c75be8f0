"""Which dtype a CPU model's many-row GEMMs (steps with prompt tokens) run in when its activations are bf16.

bf16 activations halve the bytes decode reads, and on Zen 4 a bf16 dot product (`vdpbf16ps`) also does twice the
work of a float32 FMA a cycle, so prompt GEMMs run in bf16 (oneDNN, prepacked weights). On an Intel Xeon
without AMX `vdpbf16ps` has no such edge: float32 GEMMs there ran every prompt shape of the embedded model
faster than oneDNN's bf16 (benchmarks/prompt_gemm_dtype.py; docs/benchmark-log.md). The CPU
flags do not tell the two apart, so "auto" measures: one prompt-sized GEMM each way at load, float32 when it is
at least FLOAT32_MIN_SPEEDUP x faster. The probe's answer is cached for the process (the CPU does not change).
Where oneDNN runs no bf16 GEMMs at all (AVX2 CPUs) "auto" is float32 without a probe.

float32 prompt GEMMs read a float32 copy of the weights (twice the bf16 copy's bytes): the layers' inputs are
converted at the GEMM (bf16 -> float32 is exact) and the outputs rounded back to bf16 (float32 for logits).
Packed layers (GGUF, int8/int4) take it in steps with prompt tokens, decode steps keeping the int8 path; dense
bf16 layers (layers/onednn_linear.py) in calls of DENSE_FLOAT32_MIN_ROWS rows or more, where the copy fits
(onednn_linear.copy_fits).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from kvpilot.model.choices import check_prompt_gemm_dtype
from kvpilot.model.layers.onednn_linear import bf16_linears, copy_fits, onednn_batch_hint, onednn_bf16_applies

logger = logging.getLogger("kvpilot")

# float32 must beat bf16 by this much: twice the weight bytes must buy a clear gain, and a noisy probe near 1.0x
# must not flip the choice between runs (measured ratios: ~0.5x on Zen 4, 1.4-1.9x on the Xeon above)
FLOAT32_MIN_SPEEDUP = 1.2
# Dense bf16 layers: from this many rows a GEMM is compute-bound enough that float32's rate pays for reading twice
# the bytes (the embedded model's projections from DRAM, ~15 GB/s and 150 vs 300 GFLOP/s: bf16 wins at 16 rows,
# float32 from ~24)
DENSE_FLOAT32_MIN_ROWS = 32
# the probe's GEMM: a 256-token chunk through a gate/up-sized projection (~0.45 GFLOP, a few ms each way)
PROBE_ROWS, PROBE_IN, PROBE_OUT, PROBE_ROUNDS = 256, 576, 1536, 9


@dataclass(frozen=True)
class GemmProbe:
    """GFLOP/s of the probe GEMM in oneDNN's prepacked bf16 and in float32 (best of PROBE_ROUNDS rounds)."""

    bf16_gflops: float
    float32_gflops: float

    @property
    def float32_speedup(self) -> float:
        return self.float32_gflops / self.bf16_gflops

    def faster_dtype(self) -> torch.dtype:
        return torch.float32 if self.float32_speedup >= FLOAT32_MIN_SPEEDUP else torch.bfloat16


@functools.cache
def probe_prompt_gemms() -> GemmProbe:
    """Times the probe GEMM each way on one thread, best of PROBE_ROUNDS alternating rounds (a burst of other load
    hits both, and spares some rounds); 120-180 ms. One thread: the ratio is the core's own (1.42-1.70 on the Xeon
    above, the other core busy or not), where two threads' rounds wait on whichever core a server start's other
    process holds (1.22-3.28)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _time_probe()
    finally:
        torch.set_num_threads(threads)


def _time_probe() -> GemmProbe:
    generator = torch.Generator().manual_seed(0)
    x16 = torch.randn(PROBE_ROWS, PROBE_IN, generator=generator).to(torch.bfloat16)
    w16 = torch.randn(PROBE_OUT, PROBE_IN, generator=generator).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w16, onednn_batch_hint())
    w32 = w16.float().t().contiguous().t()  # the [in, out] layout the float32 copies use (weight_layout.py)
    runs = {"bf16": lambda: torch.ops.mkldnn._linear_pointwise(x16, packed, None, "none", [], ""),
            "float32": lambda: torch.nn.functional.linear(x16.float(), w32).to(torch.bfloat16)}
    best = dict.fromkeys(runs, float("inf"))
    with torch.inference_mode():
        for run in runs.values():  # first calls pick kernels and allocate
            run()
        for _ in range(PROBE_ROUNDS):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
    flop = 2 * PROBE_ROWS * PROBE_IN * PROBE_OUT
    return GemmProbe(flop / best["bf16"] / 1e9, flop / best["float32"] / 1e9)


def resolve_prompt_gemm_dtype(name: str, compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of many-row GEMMs for activations in `compute_dtype` on `device`: compute_dtype itself unless
    they are bf16 on a CPU; there "float32" and "bfloat16" are taken as given, and "auto" is the probe's faster
    dtype where oneDNN runs bf16 (logged at debug level with both rates), else float32: without oneDNN's bf16
    path (an AVX2 CPU) torch's bf16 GEMM is a slow emulation (a batch-64 decode step of the embedded model on a
    Zen 3 EPYC took 3.3x as long as in float32)."""
    check_prompt_gemm_dtype(name)
    if compute_dtype != torch.bfloat16 or device.type != "cpu" or name == "bfloat16":
        return compute_dtype
    if name == "float32" or not onednn_bf16_applies(compute_dtype, device):
        return torch.float32
    probe = probe_prompt_gemms()
    chosen = probe.faster_dtype()
    # debug: the rates explain --prompt-gemm-dtype auto's choice to a developer; a user has nothing to act on
    logger.debug("prompt GEMMs in %s: float32 %.0f GFLOP/s, bf16 %.0f GFLOP/s on one core here (%.2fx; float32 from "
                "%.1fx); --prompt-gemm-dtype sets it", str(chosen).removeprefix("torch."), probe.float32_gflops,
                probe.bf16_gflops, probe.float32_speedup, FLOAT32_MIN_SPEEDUP)
    return chosen


def dense_float32_min_rows(model: torch.nn.Module, prompt_dtype: torch.dtype | None,
                           available_bytes: int) -> int | None:
    """DENSE_FLOAT32_MIN_ROWS when the model's dense bf16 layers should keep float32 copies (prompt GEMMs in
    float32, and the copies fit: onednn_linear.copy_fits), or None."""
    if prompt_dtype != torch.float32:
        return None
    copy_bytes = 4 * sum(linear.weight.numel() for _, _, linear in bf16_linears(model))
    fits = copy_bytes and copy_fits(copy_bytes, available_bytes, "prompt GEMMs in bf16: a float32 copy of the weights")
    return DENSE_FLOAT32_MIN_ROWS if fits else None
