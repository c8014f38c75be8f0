"""kvpilot on Ray Serve, side by side in one run (docs/ray.md), on a local Ray cluster:

1. routing: 2 replicas, prefix-aware vs round-robin, on `kvpilot bench`'s shared-prefix dataset: the
   prefix-cache hit rate by the engines' own counters, and how many replicas each prefix group reached;
2. lanes: short requests' TTFT p50 through an interactive lane + a long lane (1 replica each) vs one pool of
   2 replicas, on bench's long/short dataset.

Random weights of SmolLM2's shape (the embedded tokenizer), so it needs no download; prints the ratios.
    python benchmarks/ray_replicas.py [--routing-layers 2] [--lanes-layers 8] [--num-requests 96]
        [--routing-kv-cache-memory 3MiB]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

import kvpilot.ray
from kvpilot.bench.api import BenchConfig, run_bench
from kvpilot.bench.client import Target
from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.server.background import free_port


def model_config(directory: Path, num_layers: int) -> str:
    config = {**get_hf_config("smollm2-135m"), "num_hidden_layers": num_layers}
    path = directory / f"smollm2-{num_layers}.json"
    path.write_text(json.dumps(config))
    return str(path)


def deploy(url: str, name: str, args: dict[str, Any]) -> None:
    for app_name in list(serve.status().applications):
        serve.delete(app_name)
    serve.run(kvpilot.ray.app({**args, "name": name}), name=name, route_prefix="/")
    while httpx.get(f"{url}/health", timeout=30).status_code != 200:
        time.sleep(0.5)


def engine(model: str, **overrides: Any) -> dict[str, Any]:
    return {"model": model, "load_format": "dummy", "dtype": "float32", "max_model_len": 1024,
            "kv_cache_memory": "16MiB", "served_model_name": "tiny", **overrides}


def bench(url: str, dataset: DatasetConfig, num_requests: int, concurrency: int, out: Path) -> Any:
    target = Target(base_url=url, model="tiny", ignore_eos=True, endpoint="completions")
    outcome = run_bench(BenchConfig(target=target, dataset=dataset,
                                    load=LoadShape(concurrency=concurrency, num_requests=num_requests),
                                    tokenizer="embedded", progress=False, json_path=str(out)))
    return outcome.runs[0]


def routing(url: str, model: str, num_requests: int, kv_cache_memory: str, tmp: Path) -> None:
    dataset = DatasetConfig(kind="shared-prefix", num_prefixes=7, num_suffixes=8, prefix_len=256, input_len=272,
                            output_len=1, seed=1)
    rates = {}
    for policy in ("prefix", "round_robin"):
        deploy(url, f"routing-{policy.replace('_', '-')}",
               {**engine(model, kv_cache_memory=kv_cache_memory), "num_replicas": 2, "routing": policy})
        run = bench(url, dataset, num_requests, 2, tmp / f"{policy}.json")
        time.sleep(2.5)  # replicas report their counters about once a second
        table = httpx.get(f"{url}/v1/kvpilot/replicas", timeout=30).json()
        rates[policy] = table["prefix_cache_hit_rate"]
        spread = run.replicas.prefix_spread if run.replicas is not None else None
        print(f"routing {policy:<12} prefix-cache hit rate {rates[policy]:.3f}  replicas per prefix group "
              f"{spread if spread is None else round(spread, 2)}  per replica "
              f"{[round(r['prefix_cache_hit_rate'] or 0, 3) for r in table['replicas']]}")
    print(f"prefix routing / round-robin hit rate: {rates['prefix'] / max(rates['round_robin'], 1e-9):.2f}x")


def lanes(url: str, model: str, num_requests: int, tmp: Path) -> None:
    dataset = DatasetConfig(kind="long-short", input_len=32, output_len=8, long_fraction=0.3, long_input_len=900,
                            seed=3)
    long_engine = {"max_num_batched_tokens": 2048}
    setups = {"one pool": {**engine(model, **long_engine), "num_replicas": 2, "routing": "round_robin"},
              "two lanes": {**engine(model), "routing": "round_robin", "lanes": [
                  {"name": "interactive", "max_prompt_chars": 2000, "num_replicas": 1,
                   "engine": {"max_num_batched_tokens": 256}},
                  {"name": "long", "num_replicas": 1, "engine": long_engine}]}}
    short = {}
    for name, args in setups.items():
        deploy(url, name.replace(" ", "-"), args)
        groups = bench(url, dataset, num_requests, 8, tmp / f"{name}.json").aggregates.groups_ms
        short[name] = groups["short"]["ttft"].median
        print(f"{name:<10} TTFT p50: short {short[name]:8.1f} ms, long {groups['long']['ttft'].median:8.1f} ms")
    print(f"short TTFT p50, one pool / two lanes: {short['one pool'] / short['two lanes']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routing-layers", type=int, default=2)
    parser.add_argument("--lanes-layers", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=96)
    # ~1,000 tokens a replica at 2 layers: under half the 7 groups' prefixes, so where a group goes matters
    parser.add_argument("--routing-kv-cache-memory", default="3MiB")
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 1024 * 1024, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            routing(url, model_config(Path(tmp), args.routing_layers), args.num_requests,
                    args.routing_kv_cache_memory, Path(tmp))
            lanes(url, model_config(Path(tmp), args.lanes_layers), args.num_requests, Path(tmp))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
