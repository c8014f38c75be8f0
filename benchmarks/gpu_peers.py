"""kvpilot against a peer engine on the same GPU, weights and workload, in one run: each engine loaded once in
its own process (half the GPU's memory each), passes alternating kvpilot, peer, kvpilot, ..., and every pass
on fresh prompts (a pass never finds the last one's prefixes cached). Prints per row each engine's median output
tok/s with min-max and the median of the per-pass ratios (a peer pass against the mean of the kvpilot passes
beside it); a pass with a request that made fewer tokens than asked is reported and not used.

The peer is nano-vllm (peers/nano_vllm.py: its source exported from a clone into .peers/nano-vllm and carried,
flash-attn replaced by the Triton stand-in in peers/flash_attn_shim), or kvpilot itself (`--peer kvpilot`: an
A/A run that shows the spread of the measurement). Rows are Qwen3 (the architecture nano-vllm implements), with
random weights written once as an HF directory that both engines load; sampling at nano-vllm's bench settings
(temperature 0.6, ignore_eos). Before the passes the two engines' greedy tokens on one prompt are compared.

    python benchmarks/gpu_peers.py --export-source /path/to/nano-vllm-clone   # here, once: .peers/nano-vllm
    python benchmarks/gpu_peers.py --output peers.json                        # on the GPU (carry .peers)
    python benchmarks/gpu_peers.py --smoke --peer kvpilot                     # tiny shapes, any device
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = REPO / ".peers" / "nano-vllm"
PEERS = ("nano-vllm", "kvpilot")
CHECK_TOKENS = 8
WARMUP_SEED_OFFSET = 1000
MAX_MODEL_LEN = 4096  # nano-vllm's bench.py
TEMPERATURE = 0.6  # nano-vllm's bench.py
PEER_MEMORY_SHARE = 0.45  # the peer starts first and takes this share; kvpilot then asks for 0.9 of the total


@dataclass(frozen=True)
class PeerRow:
    key: str
    title: str
    num_requests: int
    input_range: tuple[int, int]
    output_range: tuple[int, int]


FULL_ROWS = [
    PeerRow("nano-vllm", "Qwen3-0.6B, 256 req, in/out 100-1024 (nano-vllm's bench)", 256, (100, 1024), (100, 1024)),
    PeerRow("qwen3-64", "Qwen3-0.6B, 64 req x 512 in / 256 out", 64, (512, 512), (256, 256)),
    PeerRow("qwen3-b1", "Qwen3-0.6B batch 1, 512 in / 256 out", 1, (512, 512), (256, 256)),
]
SMOKE_ROWS = [
    PeerRow("nano-vllm", "tiny Qwen3, 8 req, in/out 8-32", 8, (8, 32), (8, 32)),
    PeerRow("qwen3-b1", "tiny Qwen3 batch 1, 16 in / 8 out", 1, (16, 16), (8, 8)),
]


def make_requests(row: PeerRow, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """nano-vllm's bench draws: ids uniform in [0, 10000] (or the vocabulary), lengths uniform in the ranges."""
    rng = random.Random(seed)
    high = min(vocab_size - 1, 10_000)
    return [([rng.randint(0, high) for _ in range(rng.randint(*row.input_range))], rng.randint(*row.output_range))
            for _ in range(row.num_requests)]


def warmup_requests(row: PeerRow, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """Other prompts, a smaller batch of the row's kind: compiles and captures what the passes will use."""
    small = PeerRow(row.key, row.title, min(row.num_requests, 32), row.input_range,
                    (row.output_range[0], max(row.output_range[0], row.output_range[1] // 4)))
    return make_requests(small, vocab_size, seed + WARMUP_SEED_OFFSET)


def pass_sequence(peer_label: str, passes: int) -> list[str]:
    """kvpilot, peer, kvpilot, ..., kvpilot: every peer pass has a kvpilot pass on each side."""
    return ["kvpilot", peer_label] * passes + ["kvpilot"]


# ---- the child processes ------------------------------------------------------------------------------------


class KvpilotEngine:
    """The child side for kvpilot: `LLM(model, **settings)`."""

    def __init__(self, model: str | None, **settings) -> None:
        from kvpilot import LLM

        self._llm = LLM(model, **settings)

    @classmethod
    def for_gpu_peers(cls, model_dir: Path, max_model_len: int, gpu_memory_utilization: float) -> KvpilotEngine:
        """At its defaults, apart from the comparison's context length and memory share."""
        import torch

        share = {"gpu_memory_utilization": gpu_memory_utilization} if torch.cuda.is_available() else {}
        return cls(str(model_dir), max_model_len=max_model_len, **share)

    def generate(self, requests, temperature: float) -> list[int]:
        from kvpilot import SamplingParams

        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for _, n in requests]
        return [len(o.outputs[0].token_ids) for o in self._llm.generate([p for p, _ in requests], params)]

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        from kvpilot import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        return list(self._llm.generate([prompt], params)[0].outputs[0].token_ids)


def run_child(args: argparse.Namespace) -> None:
    from peers.engine_child import serve

    if args.child == "nano-vllm":
        from peers.nano_vllm import NanoVllmEngine
        engine = NanoVllmEngine(args.model_dir, args.max_model_len, args.gpu_memory_utilization)
    else:
        engine = KvpilotEngine.for_gpu_peers(args.model_dir, args.max_model_len, args.gpu_memory_utilization)
    serve(engine)


def start_child(label: str, engine: str, model_dir: Path, max_model_len: int, share: float, source: Path | None,
                logs: Path):
    from peers.engine_child import ChildProcess
    from peers.nano_vllm import child_pythonpath

    env = dict(os.environ)
    paths = [str(REPO / "benchmarks")]
    if engine == "nano-vllm":
        paths.insert(0, child_pythonpath(source))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", engine, "--model-dir", str(model_dir),
            "--max-model-len", str(max_model_len), "--gpu-memory-utilization", str(share)]
    began = time.perf_counter()
    child = ChildProcess(label, argv, env, logs / f"{label}.log")
    print(f"{label}: loaded, warmed up and ready in {time.perf_counter() - began:.0f} s", flush=True)
    return child


# ---- the run ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PassResult:
    row: str
    engine: str
    pass_index: int
    num_tokens: int
    seconds: float
    num_short: int

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds


def run_row(row: PeerRow, children: dict, peer_label: str, vocab_size: int, args: argparse.Namespace,
            temperature: float = TEMPERATURE) -> list[PassResult]:
    """Warm-ups, then the passes of pass_sequence, each on its engine's next set of prompts."""
    for child in children.values():
        child.run(warmup_requests(row, vocab_size, args.seed), temperature)
    results, counts = [], {label: 0 for label in children}
    for index, label in enumerate(pass_sequence(peer_label, args.passes)):
        requests = make_requests(row, vocab_size, args.seed + counts[label])  # pass k: the same prompts for both
        counts[label] += 1
        reply = children[label].run(requests, temperature)
        results.append(PassResult(row.key, label, index, reply.num_tokens, reply.seconds, reply.num_short))
        print(f"  {row.key} pass {index} {label}: {reply.tokens_per_second:,.0f} tok/s ({reply.num_tokens} tokens "
              f"in {reply.seconds:.2f} s{f', {reply.num_short} short' if reply.num_short else ''})", flush=True)
    return results


def leading_agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(row: PeerRow, results: list[PassResult], peer_label: str) -> dict:
    """Medians with min-max for each engine and for the per-pass ratio (peers.passes' rules)."""
    from peers.passes import RunRows, engine_spread, ratio_spread
    from peers.workloads import Row, Workload

    workload = Workload(row.key, row.num_requests, 0, 0, row.num_requests, 0)
    rows = [Row(engine=r.engine, workload=row.key, pass_index=r.pass_index, output_tok_s=r.tokens_per_second,
                prompt_tok_s=0.0, ttft_p50_ms=None, itl_p50_ms=None, tpot_p50_ms=None,
                num_ok=row.num_requests - r.num_short, num_errors=0, mean_output_tokens=0.0,
                client_overloaded=False) for r in results]
    passes = RunRows.of([r.engine for r in results], rows, row.key)
    metric = lambda r: r.output_tok_s  # noqa: E731
    required = min(3, sum(r.engine == peer_label for r in results))
    kvpilot = engine_spread(passes, "kvpilot", workload, metric, required)
    peer = engine_spread(passes, peer_label, workload, metric, required)
    ratio = ratio_spread(passes, "kvpilot", peer_label, workload, metric, required)
    return {"row": row.key, "title": row.title, "kvpilot": kvpilot.describe(0, " tok/s"),
            "peer": peer.describe(0, " tok/s"), "ratio": ratio.describe(2, "x"), "kvpilot_median": kvpilot.median,
            "peer_median": peer.median, "ratio_median": ratio.median if ratio.enough else None,
            "dropped": [*kvpilot.dropped, *peer.dropped, *ratio.dropped]}


def write_model(args: argparse.Namespace, workdir: Path) -> tuple[Path, int]:
    import torch
    from gpu_throughput import SMOKE_SHAPE  # the same tiny Qwen3
    from kvpilot.fit.model_catalog import get_hf_config
    from peers.random_model import write_random_model

    config = get_hf_config("qwen3-0.6b")
    if args.smoke:
        config = {**config, **SMOKE_SHAPE}
        config.pop("rope_scaling", None)
    dtype = torch.float32 if args.smoke and not torch.cuda.is_available() else torch.bfloat16
    config["dtype"] = str(dtype).removeprefix("torch.")
    directory = write_random_model(workdir / "qwen3", config, args.seed, dtype)
    return directory, config["vocab_size"]


def environment(args: argparse.Namespace, peer_commit: str | None) -> dict:
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": gpu, "torch": torch.__version__,
            "triton": triton_version, "peer": args.peer, "peer_commit": peer_commit, "passes": args.passes,
            "smoke": args.smoke, "seed": args.seed}


def peer_label_of(peer: str) -> str:
    """The peer's label in the rows: kvpilot against itself is "kvpilot-b"."""
    return "kvpilot-b" if peer == "kvpilot" else peer


def run(args: argparse.Namespace, peer_commit: str | None) -> list[dict]:
    rows = [r for r in (SMOKE_ROWS if args.smoke else FULL_ROWS) if args.rows is None or r.key in args.rows]
    peer_label = peer_label_of(args.peer)
    workdir = Path(tempfile.mkdtemp(prefix="gpu_peers-"))
    model_dir, vocab_size = write_model(args, workdir)
    print(f"weights: {model_dir} (random, seed {args.seed}); peer {args.peer} {peer_commit or ''}", flush=True)
    children = {}
    try:  # the peer first: it sizes its KV cache from the memory it finds free
        children[peer_label] = start_child(peer_label, args.peer, model_dir, MAX_MODEL_LEN, PEER_MEMORY_SHARE,
                                           args.peer_source, workdir)
        children["kvpilot"] = start_child("kvpilot", "kvpilot", model_dir, MAX_MODEL_LEN, 0.9, None, workdir)
        check_prompt = make_requests(rows[0], vocab_size, args.seed + 999)[0][0] if rows else []
        agree = leading_agreement(*(children[k].greedy(check_prompt, CHECK_TOKENS) for k in ("kvpilot", peer_label)))
        print(f"greedy agreement: {agree}/{CHECK_TOKENS} leading tokens", flush=True)
        summaries = []
        for row in rows:
            print(f"{row.title}:", flush=True)
            summaries.append({**summarize(row, run_row(row, children, peer_label, vocab_size, args), peer_label),
                              "greedy_agreement": agree})
    finally:
        for child in children.values():
            child.close()
    return summaries


def format_table(summaries: list[dict], peer_label: str) -> str:
    lines = [f"{'row':<58} {'kvpilot':>30} {peer_label:>30} {'kvpilot / peer':>24}"]
    for s in summaries:
        lines.append(f"{s['title']:<58} {s['kvpilot']:>30} {s['peer']:>30} {s['ratio']:>24}")
        lines += [f"    dropped: {d}" for d in s["dropped"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", choices=PEERS, default="nano-vllm")
    parser.add_argument("--peer-source", type=Path, default=DEFAULT_SOURCE,
                        help="the exported nano-vllm source (default .peers/nano-vllm)")
    parser.add_argument("--export-source", type=Path, metavar="GIT_DIR",
                        help="copy nano-vllm's pinned commit from this clone into --peer-source, then exit")
    parser.add_argument("--rows", nargs="+", help=f"row keys (default all: {' '.join(r.key for r in FULL_ROWS)})")
    parser.add_argument("--passes", type=int, default=3, help="peer passes per row (kvpilot runs one more)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny model and rows: checks the harness anywhere")
    parser.add_argument("--output", type=Path, help="write the environment and the rows as JSON")
    parser.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN, help=argparse.SUPPRESS)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return
    if args.export_source:
        from peers.nano_vllm import export_source
        print(f"nano-vllm source: {export_source(args.export_source, args.peer_source)}")
        return
    from peers.nano_vllm import source_commit

    peer_commit = source_commit(args.peer_source) if args.peer == "nano-vllm" else None
    summaries = run(args, peer_commit)
    print(format_table(summaries, peer_label_of(args.peer)), flush=True)
    if args.output:
        document = {"environment": environment(args, peer_commit), "results": summaries}
        args.output.write_text(json.dumps(document, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
