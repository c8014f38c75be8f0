"""kvpilot against vLLM's CPU build offline (`LLM.generate` in both, no server, no client), dense bf16 on the same
weights (kvpilot `--quantization none --dtype bfloat16` on the embedded GGUF, vLLM on its bf16 HF conversion, as
`peers_cpu.py --comparisons bf16`), workloads shaped as peers_cpu's c16 and c64: all requests submitted at once,
max_num_seqs equal to the concurrency, 128 random ids in, 128 out, ignore_eos, greedy. It separates the engines
from the serving path: served/offline per engine is peers_cpu.py's figure over this one's.

Each engine loads once in its own process (peers/engine_child.py; vLLM under its venv's interpreter, with
peers_cpu's tcmalloc, libiomp5 and thread binding) and passes alternate kvpilot, vLLM, kvpilot, ..., each on
fresh prompts; the ratio of each vLLM pass is against the mean of the kvpilot passes beside it (peers/passes.py).

    .venv/bin/python benchmarks/peers_offline.py                     # c16 and c64, 3 vLLM passes each
    .venv/bin/python benchmarks/peers_offline.py --workloads c64 --passes 5

Needs peers_cpu.py's vLLM install (its --cache-dir). Not in CI.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from gpu_peers import KvpilotEngine, PeerRow, format_table, run_row, summarize
from peers.engine_child import ChildProcess
from peers.venvs import DEFAULT_CACHE_DIR
from peers.vllm_cpu import hf_model_dir, ld_preload, vllm_venv

BENCHMARKS = Path(__file__).resolve().parent
WORKLOADS = {"c16": PeerRow("c16", "16 x (128 in, 128 out) at once, max_num_seqs 16", 64, (128, 128), (128, 128)),
             "c64": PeerRow("c64", "64 x (128 in, 128 out) at once, max_num_seqs 64", 256, (128, 128), (128, 128))}
VOCAB_SIZE = 49_152  # the embedded SmolLM2's


def start_children(max_num_seqs: int, cache_dir: Path, logs: Path) -> dict[str, ChildProcess]:
    from kvpilot.model.default_model import default_model_path

    venv = vllm_venv(cache_dir)
    model = hf_model_dir(cache_dir, default_model_path())
    if not venv.is_installed() or not model.is_dir():
        raise SystemExit(f"no vLLM install or bf16 model under {cache_dir}: run benchmarks/peers_cpu.py once")
    preload, _ = ld_preload(venv)
    threads = os.cpu_count() or 1
    vllm_env = {**os.environ, "PYTHONPATH": str(BENCHMARKS), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
                "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                **({"LD_PRELOAD": preload} if preload else {})}
    ours_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), os.environ.get("PYTHONPATH", "")])}
    children = {}
    for label, argv, env in (
            ("vllm", [str(venv.python), "-m", "peers.vllm_offline", "--model", str(model), "--max-num-seqs",
                      str(max_num_seqs)], vllm_env),
            ("kvpilot", [sys.executable, str(Path(__file__).resolve()), "--child", "--max-num-seqs",
                         str(max_num_seqs)], ours_env)):
        began = time.perf_counter()
        children[label] = ChildProcess(label, argv, env, logs / f"{label}-{max_num_seqs}.log")
        print(f"{label}: loaded and ready in {time.perf_counter() - began:.0f} s", flush=True)
    return children


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["c16", "c64"])
    parser.add_argument("--passes", type=int, default=3, help="vLLM passes per workload (kvpilot runs one more)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-num-seqs", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        from peers.engine_child import serve
        # the embedded model dequantized to dense bf16, as peers_cpu.py --comparisons bf16 serves it
        serve(KvpilotEngine(None, quantization="none", dtype="bfloat16", max_num_seqs=args.max_num_seqs))
        return
    logs = Path(tempfile.mkdtemp(prefix="peers_offline-"))
    summaries = []
    for key in args.workloads:
        row = WORKLOADS[key]
        children = start_children(row.num_requests // 4, args.cache_dir, logs)
        try:
            summaries.append(summarize(row, run_row(row, children, "vllm", VOCAB_SIZE, args, temperature=0.0), "vllm"))
        finally:
            for child in children.values():
                child.close()
    print(format_table(summaries, "vllm"), flush=True)
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
