"""`kvpilot fit --calibrate`: this machine's sustained memory bandwidth, GEMM rates and per-step overhead, measured
with kvpilot's own kernels, as a kvpilot.fit.calibration profile (the torch side of calibration: fit stays
torch-free and gets this through `set_calibrator`, installed by kvpilot.cli).

- bandwidth: a decode-shaped GEMV (one row) over a bf16 weight far larger than the caches, so every byte
  comes from memory: weight bytes / time. On a CPU the weight is held and multiplied as the model's dense bf16
  layers do it: kvpilot's kernel on the plain weight with AVX512_BF16 (model/layers/bf16_linear.py), else
  oneDNN's prepacked layout (model/layers/onednn_linear.py) where oneDNN runs bf16.
- GEMM rate: a prompt-shaped GEMM (a chunk of tokens through a square projection) in bf16 and in float32.
- step overhead: decode steps of a tiny random-weight model through the real engine (LLM), whose reads and
  FLOPs are negligible: the fixed cost every step pays (scheduling, inputs, sampling, launches).
Each rate is the best of `num_repeats` timed calls after a warm-up (the roofline wants what the machine
sustains at its best, not an average over noise).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpilot.fit.calibration import DeviceRates, MachineProfile, new_profile
from kvpilot.fit.hardware import catalog_name_of
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.llm import LLM
from kvpilot.model.layers.bf16_linear import Bf16Linear, bf16_gemm_kernel
from kvpilot.model.layers.onednn_linear import OneDnnWeight, onednn_bf16_applies
from kvpilot.sampling_params import SamplingParams

MIB = 2**20
STEP_WINDOW = 4  # decode steps timed together for the overhead
BANDWIDTH_COLUMNS = 4096  # the GEMV's input width (a 4k-hidden model's projection)
# the tiny model: Llama-shaped, small enough that its step is all overhead
TINY_MODEL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512, "tie_word_embeddings": True}


@dataclass(frozen=True)
class CalibrationSizes:
    """Measurement sizes. Invariant: all positive; the bandwidth weight should exceed the last-level cache
    (the defaults do on every CPU and GPU fit knows; tests pass small ones and accept cache speeds)."""

    cpu_weight_bytes: int = 512 * MIB
    gpu_weight_bytes: int = 2048 * MIB
    cpu_gemm_rows: int = 512
    cpu_gemm_dim: int = 2048
    gpu_gemm_rows: int = 8192
    gpu_gemm_dim: int = 8192
    num_repeats: int = 10
    num_decode_steps: int = 64  # decode steps timed for the overhead


def _best_seconds(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls after one warm-up (synchronized on a GPU)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    call()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _bf16_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """y = x @ weight^T the way kvpilot's dense bf16 layers run it on this device."""
    kernel = bf16_gemm_kernel(weight.dtype, weight.device)
    if kernel is not None:
        return Bf16Linear(weight, None, kernel)
    if onednn_bf16_applies(weight.dtype, weight.device):
        packed = OneDnnWeight(weight)
        return packed.linear
    return lambda x: F.linear(x, weight)


@torch.no_grad()
def measure_bandwidth(device: torch.device, weight_bytes: int, repeats: int) -> float:
    """Bytes/s a one-row bf16 GEMV reads its weight at."""
    rows = max(1, weight_bytes // (2 * BANDWIDTH_COLUMNS))
    # constant values: the timing does not depend on them, and filling is faster than drawing random ones
    weight = torch.full((rows, BANDWIDTH_COLUMNS), 0.01, dtype=torch.bfloat16, device=device)
    linear = _bf16_linear(weight)
    del weight  # the layer, the packed copy (CPU) or the closure (GPU) keeps what the GEMV reads
    x = torch.ones(1, BANDWIDTH_COLUMNS, dtype=torch.bfloat16, device=device)
    return rows * BANDWIDTH_COLUMNS * 2 / _best_seconds(lambda: linear(x), device, repeats)


@torch.no_grad()
def measure_gemm(device: torch.device, dtype: torch.dtype, rows: int, dim: int, repeats: int) -> float:
    """FLOP/s of a [rows, dim] x [dim, dim] GEMM in `dtype` (bf16 through kvpilot's dense path)."""
    weight = torch.randn(dim, dim, device=device).to(dtype)
    x = torch.randn(rows, dim, device=device).to(dtype)
    linear = _bf16_linear(weight) if dtype == torch.bfloat16 else (lambda a: F.linear(a, weight))
    return 2.0 * rows * dim * dim / _best_seconds(lambda: linear(x), device, repeats)


def _tiny_llm(device: torch.device) -> LLM:
    """An LLM of the tiny random-weight model on `device`, its start-up lines kept out of the user's log (they
    would read as the user's model's)."""
    quiet = logging.getLogger("kvpilot")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps({**get_hf_config("smollm2-135m"), **TINY_MODEL}))
            return LLM(str(path), load_format="dummy", dtype="bfloat16", device=device.type, max_model_len=128,
                       max_num_seqs=1, kv_cache_memory="16MiB")
    finally:
        quiet.setLevel(level)


def measure_step_overhead(device: torch.device, num_decode_steps: int) -> float:
    """Seconds of one decode step of a tiny model through the engine: the fastest mean over STEP_WINDOW
    consecutive steps (steps of one sequence are alike, so slower windows are other processes taking the
    cores; a window rather than one step, because with async scheduling one step's call may return early
    and the next wait for it)."""
    llm = _tiny_llm(device)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up: kernels built, graphs
    engine = llm.engine
    engine.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=2 + num_decode_steps, ignore_eos=True))
    engine.step()  # the prefill
    stamps = [time.perf_counter()]
    while engine.has_unfinished_requests():
        engine.step()
        stamps.append(time.perf_counter())
    window = min(STEP_WINDOW, len(stamps) - 1)
    return min((stamps[i + window] - stamps[i]) / window for i in range(len(stamps) - window))


def measure_device(device: torch.device, name: str, sizes: CalibrationSizes) -> DeviceRates:
    """All rates of one device."""
    gpu = device.type == "cuda"
    rows, dim = (sizes.gpu_gemm_rows, sizes.gpu_gemm_dim) if gpu else (sizes.cpu_gemm_rows, sizes.cpu_gemm_dim)
    return DeviceRates(
        name=name,
        bandwidth_bytes_per_s=measure_bandwidth(device, sizes.gpu_weight_bytes if gpu else sizes.cpu_weight_bytes,
                                                sizes.num_repeats),
        bf16_flops=measure_gemm(device, torch.bfloat16, rows, dim, sizes.num_repeats),
        fp32_flops=measure_gemm(device, torch.float32, rows, dim, sizes.num_repeats),
        step_overhead_seconds=measure_step_overhead(device, sizes.num_decode_steps),
        catalog_name=(catalog_name_of(name) or "") if gpu else "",
    )


def calibrate(sizes: CalibrationSizes | None = None) -> MachineProfile:
    """Measures the CPU, and the first CUDA GPU when torch sees one (its float32 GEMMs in full precision:
    torch's default, no TF32, which kvpilot keeps)."""
    sizes = sizes or CalibrationSizes()
    cpu = measure_device(torch.device("cpu"), "cpu", sizes)
    gpu = None
    if torch.cuda.is_available():
        gpu = measure_device(torch.device("cuda", 0), torch.cuda.get_device_name(0), sizes)
    return new_profile(cpu, gpu, method="kvpilot kernels")
