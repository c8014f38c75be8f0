"""Attention kernels alone on a GPU: the Triton backend next to the torch reference backend on the same
cache, each checked against the other first, timed by CUDA events (median), with achieved bandwidth
(decode, KV write) and FLOP/s (prefill) to compare with the H100's ~3.0 TB/s and ~800 TFLOP/s.

    python benchmarks/attention_kernels.py                 # Llama-3.1-8B heads (32 q / 8 kv, dim 128), bf16
    python benchmarks/attention_kernels.py --kv-cache-dtype fp8

Cases: KV write of a 256-token decode step and an 8k-token prefill (torch index_copy_ vs the Triton
kernel); decode of 256 sequences x ~1k context and of 1 x 32k (split-KV); prefill of an 8k prompt and of
a 2k chunk after a 30k prefix.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
from triton_cases import make_step  # noqa: E402  (the tests' step builder: random block placement)

from kvpilot.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kvpilot.model.layers.paged_attention import write_kv  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _bench(fn) -> float:
    """Median milliseconds (events), after warm-up."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _attention_case(name: str, seqs: list[tuple[int, int]], kv_dtype: torch.dtype, scale: float) -> None:
    from kvpilot.model.attention.triton_backend import TritonAttentionBackend
    step = make_step(seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, kv_dtype, seed=1)
    q, k, v, cache = (t.cuda() for t in (step.q, step.k, step.v, step.cache))
    timings, outputs = {}, {}
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        backend.kv_cache_shape(cache.shape[2], BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        meta = backend.build(step.layout, q.device)
        run_cache = cache.clone()
        outputs[backend.name] = backend.forward(q, k, v, run_cache, meta, scale).float()
        timings[backend.name] = _bench(lambda: backend.forward(q, k, v, run_cache, meta, scale))
    err = ((outputs["triton"] - outputs["torch"]).norm() / outputs["torch"].norm()).item()
    contexts = step.layout.context_lens
    kv_bytes = int(contexts.sum()) * KV_HEADS * HEAD_DIM * 2 * cache.element_size()
    flops = sum(4 * HEADS * HEAD_DIM * n * (s + (n + 1) / 2) for s, n in seqs)
    t = timings["triton"]
    print(f"{name:<34} torch {timings['torch'] * 1e3:9.1f} us  triton {t * 1e3:9.1f} us  "
          f"x{timings['torch'] / t:5.2f}  {kv_bytes / t / 1e6:7.0f} GB/s KV  {flops / t / 1e9:7.1f} TFLOP/s  "
          f"rel err {err:.1e}", flush=True)


def _prefill_sweep(name: str, seqs: list[tuple[int, int]], kv_dtype: torch.dtype, scale: float,
                   tiles: list[tuple[int, int, int, int]]) -> None:
    """The Triton prefill at each (BLOCK_M, BLOCK_N, warps, stages), each checked against the default's output."""
    from kvpilot.model.attention.triton_backend import TritonAttentionBackend
    from kvpilot.model.attention.triton_prefill import prefill_attention
    step = make_step(seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, kv_dtype, seed=1)
    q, k, v, cache = (t.cuda() for t in (step.q, step.k, step.v, step.cache))
    backend = TritonAttentionBackend()
    backend.kv_cache_shape(cache.shape[2], BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    meta = backend.build(step.layout, q.device)
    flops = sum(4 * HEADS * HEAD_DIM * n * (s + (n + 1) / 2) for s, n in seqs)

    def run(config):
        out = torch.empty_like(q)
        prefill_attention(q, k, v, cache, out, meta.prefill_seqs, meta.query_start, meta.seq_lens,
                          meta.block_tables, meta.max_prefill_len, scale, tiles=config)
        return out

    reference = run(None).float()
    for config in tiles:
        try:
            out = run(config).float()
            err = ((out - reference).norm() / reference.norm()).item()
            t = _bench(lambda: run(config))
            print(f"{name:<34} tiles {'x'.join(map(str, config)):<12} {t * 1e3:9.1f} us  "
                  f"{flops / t / 1e9:7.1f} TFLOP/s  rel err vs default {err:.1e}", flush=True)
        except Exception as exc:  # noqa: BLE001  (a config that does not compile: say so, try the next)
            print(f"{name:<34} tiles {'x'.join(map(str, config)):<12} failed: {type(exc).__name__}: {exc}"[:200])


def _decode_sweep(name: str, seqs: list[tuple[int, int]], kv_dtype: torch.dtype, scale: float,
                  partitions: list[int]) -> None:
    """The Triton decode (KV write included) with each forced split partition next to the chosen one (0), each
    checked against the chosen one's output: whether the split rule fits small batches."""
    from kvpilot.model.attention.triton_backend import TritonAttentionBackend
    step = make_step(seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, kv_dtype, seed=1)
    q, k, v, cache = (t.cuda() for t in (step.q, step.k, step.v, step.cache))
    reference = None
    for partition in [0, *partitions]:
        backend = TritonAttentionBackend(decode_partition=partition or None)
        backend.kv_cache_shape(cache.shape[2], BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        meta = backend.build(step.layout, q.device)
        run_cache = cache.clone()
        out = backend.forward(q, k, v, run_cache, meta, scale).float()
        reference = out if reference is None else reference
        err = ((out - reference).norm() / reference.norm()).item()
        t = _bench(lambda: backend.forward(q, k, v, run_cache, meta, scale))
        split = meta.decode_split
        print(f"{name:<34} partition {split.partition_size:>5} x {split.num_splits:>3} splits"
              f"{' (chosen)' if not partition else '':<9} {t * 1e3:8.1f} us  rel err {err:.1e}", flush=True)


def _write_case(num_tokens: int, kv_dtype: torch.dtype) -> None:
    from kvpilot.model.attention.triton_kv_write import write_kv_triton
    num_blocks = 4 * num_tokens // BLOCK_SIZE
    cache = torch.zeros(2, KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM, dtype=kv_dtype, device="cuda")
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    slots = torch.from_numpy(np.random.default_rng(0).permutation(num_blocks * BLOCK_SIZE)[:num_tokens]).cuda()
    slots32 = slots.to(torch.int32)
    ref = cache.clone()
    write_kv(ref, k, v, slots)
    write_kv_triton(cache, k, v, slots32)
    assert torch.equal(ref.view(torch.uint8), cache.view(torch.uint8)), "the Triton KV write differs from torch"
    torch_ms = _bench(lambda: write_kv(ref, k, v, slots))
    triton_ms = _bench(lambda: write_kv_triton(cache, k, v, slots32))
    moved = 2 * num_tokens * KV_HEADS * HEAD_DIM * (2 + cache.element_size())  # read bf16, write cache dtype
    print(f"{f'KV write, {num_tokens} tokens':<34} torch {torch_ms * 1e3:9.1f} us  triton {triton_ms * 1e3:9.1f} us  "
          f"x{torch_ms / triton_ms:5.2f}  {moved / triton_ms / 1e6:7.0f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--prefill-tiles", nargs="*", default=[],
                        help="Also time the prefill at these BLOCK_MxBLOCK_NxWARPSxSTAGES, e.g. 128x64x8x3")
    parser.add_argument("--decode-partitions", nargs="*", type=int, default=[],
                        help="Also time small-batch decodes with these split partitions (keys), e.g. 64 128 512")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (the kernels' correctness on CPU: pytest tests/model/test_triton_attention.py)")
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, heads {HEADS}/{KV_HEADS} x {HEAD_DIM}, "
          f"KV {kv_dtype}", flush=True)
    for num_tokens in (256, 8192):
        _write_case(num_tokens, kv_dtype)
    rng = np.random.default_rng(0)
    scale = HEAD_DIM ** -0.5
    _attention_case("decode 256 x ~1k context", [(int(c), 1) for c in rng.integers(512, 1536, 256)], kv_dtype, scale)
    _attention_case("decode 1 x 32k context", [(32767, 1)], kv_dtype, scale)
    _attention_case("decode 8 x 8k context", [(8191, 1)] * 8, kv_dtype, scale)
    _attention_case("prefill 8k prompt", [(0, 8192)], kv_dtype, scale)
    _attention_case("prefill 2k chunk after 30k prefix", [(30720, 2048)], kv_dtype, scale)
    tiles = [tuple(int(n) for n in t.split("x")) for t in args.prefill_tiles]
    if tiles:
        _prefill_sweep("prefill 8k prompt", [(0, 8192)], kv_dtype, scale, tiles)
        _prefill_sweep("prefill 2k chunk after 30k prefix", [(30720, 2048)], kv_dtype, scale, tiles)
    for name, seqs in (("decode 1 x 512", [(511, 1)]), ("decode 1 x 4k", [(4095, 1)]), ("decode 8 x 512", [(511, 1)] * 8)):
        if args.decode_partitions:
            _decode_sweep(name, seqs, kv_dtype, scale, args.decode_partitions)


if __name__ == "__main__":
    main()
