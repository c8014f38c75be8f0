"""Staged inputs for the rules that read the server's configuration and the host's CPU use, which
saved bench files do not carry: each builds :class:`DoctorInputs` the way a live probe does (bench
result documents plus a ``ServerConfig`` from kvpilot's real capacity JSON, or a ``ResourceUsage``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from kvpilot.doctor.inputs import DoctorInputs, load_inputs
from kvpilot.doctor.resources import Competitor, ResourceUsage
from kvpilot.doctor.server_config import ServerConfig, from_capacity
from tests.doctor.builders import closed_loop, jitter, req, run, samples, write

FP32_BLOCK = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2-135M, float32 K and V, 16 tokens


def capacity_json(kv_mib: int, max_model_len: int, **overrides: object) -> dict[str, object]:
    """What a kvpilot server on SmolLM2-135M (float32) answers at GET /v1/kvpilot/capacity."""
    num_blocks = kv_mib * 2**20 // FP32_BLOCK
    doc: dict[str, object] = {
        "model": "SmolLM2-135M-Instruct", "num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64,
        "kv_dtype_bytes": 4, "kv_cache_dtype": "float32", "kv_cache_memory_bytes": kv_mib * 2**20,
        "block_size": 16, "num_blocks": num_blocks, "bytes_per_block": FP32_BLOCK, "max_model_len": max_model_len,
        "max_num_seqs": 256, "max_num_batched_tokens": 2048, "enable_prefix_caching": True, "dtype": "float32"}
    doc.update(overrides)
    return doc


def _healthy_files(tmp: Path, concurrency: int = 4, running: float = 4, itl: float = 12.0) -> list[str]:
    rng = random.Random(21)
    recs = closed_loop(30, concurrency, lambda i, t: req(i, t, prompt=int(jitter(rng, 48)), num_out=8,
                                                          prefill=jitter(rng, 40), itl=itl))
    return [write(tmp / "r.json", [run(f"concurrency={concurrency}", recs, concurrency=concurrency,
                                       metrics=samples(2, running=running, waiting=0, kv=0.3))])]


def _with(tmp: Path, config: ServerConfig | None = None, resources: ResourceUsage | None = None,
          **kwargs: float) -> DoctorInputs:
    base = load_inputs(_healthy_files(tmp, **kwargs))  # type: ignore[arg-type]
    return DoctorInputs(base.runs, base.metrics, base.roofline, base.sources, config, resources)


def kv_pool_too_small(tmp: Path) -> DoctorInputs:
    """`--kv-cache-memory 24MiB --max-model-len 512`, float32: 34 blocks, about one max-length request;
    the short probe traffic keeps the pool at 30% and does not show it."""
    return _with(tmp, from_capacity(capacity_json(24, 512)))


def seqs_over_kv(tmp: Path) -> DoctorInputs:
    """256 sequences allowed, 64 MiB of float32 KV: 22 requests of the measured size fit, and this
    load (24 in flight) reached that."""
    return _with(tmp, from_capacity(capacity_json(64, 64)), concurrency=24, running=24)


def token_budget_below_seqs(tmp: Path) -> DoctorInputs:
    """`--max-num-seqs 512 --max-num-batched-tokens 256` with a pool that holds it all."""
    return _with(tmp, from_capacity(capacity_json(4096, 1024, max_num_seqs=512, max_num_batched_tokens=256)))


def prefix_caching_off(tmp: Path) -> DoctorInputs:
    """`--no-enable-prefix-caching` under traffic without shared prefixes: a low note only."""
    return _with(tmp, from_capacity(capacity_json(4096, 1024, enable_prefix_caching=False)))


def cpu_starvation(tmp: Path) -> DoctorInputs:
    """Two busy processes on a 2-core host: the server's threads waited for a CPU 70% of their
    runnable time; its TPOT grows 3x from 1 to 8 clients (slow steps), decode-bound defers."""
    rng = random.Random(22)
    low = closed_loop(10, 1, lambda i, t: req(i, t, prompt=48, num_out=8, itl=jitter(rng, 100)))
    high = closed_loop(24, 8, lambda i, t: req(i, t, prompt=48, num_out=8, itl=jitter(rng, 300)))
    files = [write(tmp / "low.json", [run("concurrency=1", low, concurrency=1)]),
             write(tmp / "high.json", [run("concurrency=8", high, concurrency=8)])]
    base = load_inputs(files)
    usage = ResourceUsage(source="/proc of local server pid 100", wall_s=30.0, num_cpus=2, server_pids=(100,),
                          server_cores=0.55, run_queue_share=0.7, host_busy_share=1.0, steal_share=0.0,
                          load_avg_1m=4.2, doctor_cores=0.1,
                          competitors=(Competitor(200, "spin", 0.7), Competitor(201, "spin", 0.65)))
    return DoctorInputs(base.runs, base.metrics, base.roofline, base.sources, None, usage)


HOST_SCENARIOS: dict[str, Callable[[Path], DoctorInputs]] = {
    "kv-pool-too-small": kv_pool_too_small, "max-num-seqs-over-kv": seqs_over_kv,
    "token-budget-below-seqs": token_budget_below_seqs, "prefix-caching-off": prefix_caching_off,
    "cpu-starvation": cpu_starvation,
}
