"""kvpilot side by side with llama.cpp and vLLM's CPU build, on the same embedded GGUF (issue 18 item 5).

Not in CI. Peers are installed once into their own virtual environments under --cache-dir (reused when
their marker file says the install finished): llama-cpp-python[server] built with this CPU's flags (also
giving llama.cpp's C++ llama-server, which has parallel slots), and vLLM's CPU build per MACHINE-FACTS.
Servers run one at a time, alternating kvpilot, peer, kvpilot, peer2, kvpilot, and each is driven by
`kvpilot bench` (streaming, ignore_eos, 128 in / 128 out at concurrency 1, 16, 64; 512-token prefill).

    .venv/bin/python benchmarks/peers_cpu.py                         # all engines, all workloads
    .venv/bin/python benchmarks/peers_cpu.py --install-only          # only set up the peers (~15 min)
    .venv/bin/python benchmarks/peers_cpu.py --engines kvpilot,vllm --workloads c1,c64 --json rows.json
    .venv/bin/python benchmarks/peers_cpu.py --engines kvpilot --quick --kvpilot-arg=--kv-cache-dtype=bfloat16

Run it on a quiet machine: vLLM binds every core, and any other load skews all engines.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from kvpilot.model.default_model import default_model_path
from peers.install import PEER_ENGINES, install_peers
from peers.kvpilot_engine import kvpilot_server_spec
from peers.llamacpp import llamacpp_py_server_spec, llamacpp_server_spec
from peers.report import describe_machine, ratio_lines, rows_table
from peers.servers import ServerSpec, ServerStartError, free_port, running_server
from peers.venvs import DEFAULT_CACHE_DIR
from peers.vllm_cpu import ld_preload, vllm_server_spec, vllm_venv
from peers.workloads import Row, Workload, bench_has_temperature, default_workloads, run_workload

ENGINES = ("kvpilot", *PEER_ENGINES)
REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="kvpilot,llamacpp,vllm",
                        help=f"comma-separated, from {','.join(ENGINES)} (llamacpp-py: llama-cpp-python's own "
                             "server, one request at a time)")
    parser.add_argument("--workloads", default="c1,c16,c64,prefill", help="comma-separated, from c1,c16,c64,prefill")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests (a smoke run)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="peers' venvs, builds, runs")
    parser.add_argument("--kvpilot-arg", action="append", default=[], help="extra `kvpilot serve` argument "
                        "(repeat; use --kvpilot-arg=--flag=value for flags)")
    parser.add_argument("--json", type=Path, help="write the machine, settings and rows here")
    parser.add_argument("--install-only", action="store_true", help="set up the selected peers, then exit")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every engine")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens of c1/c16/c64")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens of c1/c16/c64")
    parser.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill workload")
    parser.add_argument("--prefill-concurrency", type=int, default=4, help="streams in the prefill workload")
    parser.add_argument("--max-start-s", type=float, default=900, help="longest wait for a server to be ready")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed of the first workload")
    args = parser.parse_args(argv)
    args.engines = _checked_list(parser, "--engines", args.engines, ENGINES)
    args.workloads = _checked_list(parser, "--workloads", args.workloads, ("c1", "c16", "c64", "prefill"))
    return args


def _checked_list(parser: argparse.ArgumentParser, flag: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    items = [item.strip() for item in value.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        parser.error(f"{flag}: unknown or empty {unknown or value!r}; choose from {','.join(allowed)}")
    return items


def engine_sequence(engines: list[str]) -> list[str]:
    """kvpilot before, between and after the peers (drift shows as a change between kvpilot passes)."""
    peers = [engine for engine in engines if engine != "kvpilot"]
    if "kvpilot" not in engines:
        return peers
    sequence = ["kvpilot"]
    for peer in peers:
        sequence += [peer, "kvpilot"]
    return sequence


def server_spec(engine: str, args: argparse.Namespace, gguf: Path, workloads: list[Workload]) -> ServerSpec:
    port = free_port()
    max_streams = max(w.concurrency for w in workloads)
    # Tokens one request can hold (bench's prompts may re-encode a few tokens longer), rounded up to 256.
    max_request_len = -(-(max(w.input_len + w.output_len for w in workloads) + 64) // 256) * 256
    if engine == "kvpilot":
        return kvpilot_server_spec(port, args.threads, args.kvpilot_arg)
    if engine == "llamacpp":
        return llamacpp_server_spec(args.cache_dir, gguf, port, args.threads, max_streams, max_request_len)
    if engine == "llamacpp-py":
        return llamacpp_py_server_spec(args.cache_dir, gguf, port, args.threads, max(2048, max_request_len))
    return vllm_server_spec(args.cache_dir, gguf, port, args.threads, max(2048, max_request_len),
                            kv_cache_space_gib=4)


def run_engine(engine: str, pass_index: int, spec: ServerSpec, workloads: list[Workload],
               args: argparse.Namespace, results_dir: Path) -> list[Row]:
    rows = []
    log_path = results_dir / f"{engine}-{pass_index}-server.log"
    started = time.monotonic()
    with running_server(spec, log_path, args.max_start_s) as base_url:
        print(f"[{engine} pass {pass_index}] ready in {time.monotonic() - started:.0f} s at {base_url}", flush=True)
        for index, workload in enumerate(workloads):
            try:
                row = run_workload(engine, pass_index, base_url, workload, args.seed + index, results_dir)
            except (RuntimeError, OSError, KeyError) as error:
                print(f"[{engine} pass {pass_index}] {workload.name}: no result ({error})", flush=True)
                continue
            rows.append(row)
            print(rows_table([row])[1], flush=True)
    return rows


def set_up_peers(args: argparse.Namespace, gguf: Path) -> dict[str, str]:
    """Installs the selected peers (reusing finished installs); {engine: one-line reason} for those left out."""
    peers = [engine for engine in args.engines if engine != "kvpilot"]
    failures = install_peers(peers, args.cache_dir, gguf, num_build_jobs=args.threads)
    for engine, reason in failures.items():
        print(f"# {engine}: cannot be installed on this box, going on without it: {reason}", flush=True)
    if "vllm" in peers and "vllm" not in failures:
        missing = ld_preload(vllm_venv(args.cache_dir))[1]
        if missing:
            print(f"# vllm: running without LD_PRELOAD of {', '.join(missing)} (slower)", flush=True)
    return failures


def print_settings(args: argparse.Namespace, sequence: list[str], workloads: list[Workload],
                   results_dir: Path) -> None:
    if not bench_has_temperature():
        print("# kvpilot bench sends no temperature: each server samples at its default (kvpilot 1.0; the "
              "peers are started greedy where they can be)")
    print(f"# engines in order: {' -> '.join(sequence)}; logs and bench JSON in {results_dir}")
    print(f"# {args.threads} threads per engine; " + "; ".join(
        f"{w.name}: {w.concurrency} streams x {w.num_requests} requests, {w.input_len} in / {w.output_len} out"
        for w in workloads) + (f"; kvpilot serve {' '.join(args.kvpilot_arg)}" if args.kvpilot_arg else ""),
        flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the running server's process group is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.cache_dir = args.cache_dir.expanduser()
    gguf = default_model_path()
    machine = describe_machine(REPO_ROOT)
    print("\n".join(machine.header_lines()), flush=True)
    failures = set_up_peers(args, gguf)
    if args.install_only:
        ready = [engine for engine in args.engines if engine != "kvpilot" and engine not in failures]
        print(f"# ready under {args.cache_dir}: {', '.join(ready) or 'none'}")
        return 1 if failures else 0

    sequence = engine_sequence([engine for engine in args.engines if engine not in failures])
    workloads = [w for w in default_workloads(args.quick, args.prefill_concurrency, args.input_len,
                                              args.output_len, args.prefill_len) if w.name in args.workloads]
    results_dir = args.cache_dir / "runs" / time.strftime("%Y%m%d-%H%M%S")
    results_dir.mkdir(parents=True, exist_ok=True)
    print_settings(args, sequence, workloads, results_dir)

    rows: list[Row] = []
    print(rows_table([])[0], flush=True)
    for pass_index, engine in enumerate(sequence):
        try:
            rows += run_engine(engine, pass_index, server_spec(engine, args, gguf, workloads), workloads, args,
                               results_dir)
        except ServerStartError as error:
            print(f"[{engine} pass {pass_index}] did not start: {error}", flush=True)

    print("\n" + "\n".join(machine.header_lines()))
    print("\n".join(rows_table(rows)))
    ratios = ratio_lines(rows, {w.name for w in workloads if w.is_prefill})
    if ratios:
        print("\n" + "\n".join(ratios))
    if args.json:
        document = {"machine": asdict(machine), "engines": sequence, "failures": failures,
                    "workloads": [asdict(w) for w in workloads], "kvpilot_args": args.kvpilot_arg,
                    "bench_sends_temperature": bench_has_temperature(), "rows": [r.to_json() for r in rows]}
        args.json.write_text(json.dumps(document, indent=2))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
