"""kvpilot side by side with llama.cpp and vLLM's CPU build, on the same embedded GGUF (issues 18, 44, 50).

Not in CI. Peers are installed once into their own virtual environments under --cache-dir (reused when
their marker file says the install finished): llama-cpp-python[server] built with this CPU's flags (also
giving llama.cpp's C++ llama-server, which has parallel slots), and vLLM's CPU build per MACHINE-FACTS.
Comparisons (peers/comparisons.py): default (kvpilot's defaults against --engines, as always run), bf16 (kvpilot
dense bf16 against vLLM bf16, both from the same GGUF), and q4_0, q4_k_m and, when asked, iq4_xs (a Q4_0 / Q4_K_M /
IQ4_XS copy of the GGUF, made once with llama.cpp's quantizer and its type mix printed, served by kvpilot and by
llama-server with --parallel equal to each workload's concurrency: its own default with an explicit --parallel, one
KV buffer per slot, the "high-throughput mode" of llama.cpp PR 14363; --llama-kv-unified gives it one shared buffer
instead, whose attention spans every slot's tokens and so slows many streams). Servers run one at a time,
alternating kvpilot, peer, kvpilot, ... for --passes rounds, each driven by `kvpilot bench` (streaming, ignore_eos,
128 in / 128 out at concurrency 1, 16, 64; 512-token prefill). Each figure is a median over valid passes with its
min-max; a pass with failed or short requests is dropped and named (peers/passes.py). Each
row also has the server's peak RSS (its processes' VmHWM, load included), and the report sets every server's
side by side, so kvpilot on the Q4_K_M copy meets kvpilot on the Q4_0 copy in the same run.

    .venv/bin/python benchmarks/peers_cpu.py                         # every comparison but iq4_xs, 3 passes
    .venv/bin/python benchmarks/peers_cpu.py --install-only          # only set up the peers (~15 min)
    .venv/bin/python benchmarks/peers_cpu.py --comparisons q4_k_m,q4_0 --workloads c1,c16,c64 --json rows.json
    .venv/bin/python benchmarks/peers_cpu.py --comparisons iq4_xs --engines kvpilot,llamacpp --workloads c1,c16
    .venv/bin/python benchmarks/peers_cpu.py --comparisons default --engines kvpilot --passes 1 --quick \
        --kvpilot-arg=--kv-cache-dtype=bfloat16

Run it on a quiet machine: vLLM binds every core, and any other load skews all engines.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvpilot.model.default_model import default_model_path
from peers.comparisons import COMPARISON_NAMES, DEFAULT_COMPARISONS, Comparison, Contender, build_comparisons
from peers.install import PEER_ENGINES, install_peers
from peers.kvpilot_engine import kvpilot_server_spec, kvpilot_weight_args
from peers.llamacpp import (KV_UNIFIED_FLAG, has_flag, llama_server_help, llamacpp_py_server_spec,
                            llamacpp_server_spec, llamacpp_venv)
from peers.passes import MIN_VALID_PASSES
from peers.quantize import REQUANTIZED_MIXES, RequantizedCopy, ensure_requantized_copy, read_copy
from peers.report import comparison_lines, describe_machine, memory_lines, rows_table
from peers.servers import RunningServer, ServerSpec, ServerStartError, free_port, running_server
from peers.venvs import DEFAULT_CACHE_DIR, InstallError
from peers.vllm_cpu import ld_preload, vllm_server_spec, vllm_venv
from peers.workloads import Row, Workload, bench_has_temperature, default_workloads, run_workload

ENGINES = ("kvpilot", *PEER_ENGINES)
REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comparisons", default=",".join(DEFAULT_COMPARISONS),
                        help="comma-separated, from default (kvpilot's defaults against --engines), bf16 (kvpilot "
                             "--quantization none against vLLM bf16), q4_0, q4_k_m and iq4_xs (kvpilot against "
                             "llama-server on a copy made by llama.cpp's quantizer, fair slots); default: all but "
                             "iq4_xs")
    parser.add_argument("--engines", default="kvpilot,llamacpp,vllm",
                        help=f"the default comparison's engines, comma-separated, from {','.join(ENGINES)} "
                             "(llamacpp-py: llama-cpp-python's own server, one request at a time)")
    parser.add_argument("--workloads", default="c1,c16,c64,prefill", help="comma-separated, from c1,c16,c64,prefill")
    parser.add_argument("--passes", type=int, default=MIN_VALID_PASSES,
                        help=f"alternating rounds per peer (figures need {MIN_VALID_PASSES} valid passes)")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests (a smoke run)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="peers' venvs, builds, runs")
    parser.add_argument("--kvpilot-arg", action="append", default=[], help="extra `kvpilot serve` argument for "
                        "every kvpilot contender (repeat; use --kvpilot-arg=--flag=value for flags)")
    parser.add_argument("--json", type=Path, help="write the machine, settings, rows and figures here")
    parser.add_argument("--install-only", action="store_true", help="set up the selected peers (and the "
                        "requantized copies), then exit")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every engine")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens of c1/c16/c64")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens of c1/c16/c64")
    parser.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill workload")
    parser.add_argument("--prefill-concurrency", type=int, default=4, help="streams in the prefill workload")
    parser.add_argument("--max-start-s", type=float, default=900, help="longest wait for a server to be ready")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed of the first workload")
    parser.add_argument("--llama-kv-unified", action="store_true",
                        help="llama-server with slots per workload also gets --kv-unified (one KV buffer for all "
                             "slots; without it each slot has its own, llama.cpp's default with --parallel N)")
    args = parser.parse_args(argv)
    args.comparisons = _checked_list(parser, "--comparisons", args.comparisons, COMPARISON_NAMES)
    args.engines = _checked_list(parser, "--engines", args.engines, ENGINES)
    args.workloads = _checked_list(parser, "--workloads", args.workloads, ("c1", "c16", "c64", "prefill"))
    if args.passes < 1:
        parser.error(f"--passes must be at least 1 (got {args.passes}); figures need {MIN_VALID_PASSES}")
    return args


def _checked_list(parser: argparse.ArgumentParser, flag: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    items = list(dict.fromkeys(item.strip() for item in value.split(",") if item.strip()))
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        parser.error(f"{flag}: unknown or empty {unknown or value!r}; choose from {','.join(allowed)}")
    return items


@dataclass
class Setup:
    """What the run can use: peers and copies that could not be made ({engine or copy key: one-line reason}),
    the requantized copies of the GGUF ({"q4_0": ..., "q4_k_m": ...}), and whether this llama-server has
    --kv-unified and the run asked for it (--llama-kv-unified)."""

    gguf: Path
    failures: dict[str, str] = field(default_factory=dict)
    copies: dict[str, RequantizedCopy] = field(default_factory=dict)
    kv_unified: bool = False
    vllm_untuned: list[str] = field(default_factory=list)  # what vLLM's tuned start (LD_PRELOAD) lacks here

    def gguf_for(self, weights: str) -> Path:
        """The GGUF a contender with `weights` serves: its requantized copy, else the embedded GGUF."""
        if weights not in REQUANTIZED_MIXES:
            return self.gguf
        if weights not in self.copies:
            raise ValueError(f"the {weights} contenders need the {REQUANTIZED_MIXES[weights].name} copy of the "
                             "GGUF; it was not made")
        return self.copies[weights].path


def untuned_note(missing: list[str]) -> str:
    """The line every vLLM figure of a run carries when its tuned start was not possible here."""
    return (f"ran without LD_PRELOAD of {', '.join(missing)}, not the configuration its users run: its figures are "
            "low and ratios against it overstate kvpilot")


def set_up(args: argparse.Namespace, gguf: Path, comparisons: list[Comparison]) -> Setup:
    """Installs the peers the comparisons need (reusing finished installs) and makes the requantized copies."""
    setup = Setup(gguf)
    needed = sorted(set().union(*(c.engines() for c in comparisons)))
    setup.failures = install_peers(needed, args.cache_dir, gguf, num_build_jobs=args.threads)
    for engine, reason in setup.failures.items():
        print(f"# {engine}: cannot be installed on this box, going on without it: {reason}", flush=True)
    if "vllm" in needed and "vllm" not in setup.failures:
        setup.vllm_untuned = ld_preload(vllm_venv(args.cache_dir))[1]
        if setup.vllm_untuned:
            print(f"# vllm: {untuned_note(setup.vllm_untuned)}", flush=True)
    weights = dict.fromkeys(c.weights for comparison in comparisons for c in comparison.contenders())
    make_copies(args, setup, [w for w in weights if w in REQUANTIZED_MIXES])
    if args.llama_kv_unified and any(p.slots_per_workload for c in comparisons for p in c.peers) \
            and "llamacpp" not in setup.failures:
        try:
            setup.kv_unified = has_flag(llama_server_help(args.cache_dir), KV_UNIFIED_FLAG)
        except (InstallError, OSError) as error:
            print(f"# llama-server --help failed ({error}); running without {KV_UNIFIED_FLAG}", flush=True)
        print(f"# llama-server {'has' if setup.kv_unified else 'LACKS (runs without it)'} {KV_UNIFIED_FLAG}",
              flush=True)
    return setup


def make_copies(args: argparse.Namespace, setup: Setup, keys: list[str]) -> None:
    """Makes (or reuses) the requantized copies `keys` name with llama.cpp's quantizer and prints each one's
    type mix; a copy that cannot be made is a failure under its key, which leaves its comparison out."""
    for key in keys:
        mix = REQUANTIZED_MIXES[key]
        if "llamacpp" in setup.failures:
            setup.failures[key] = f"no {mix.name} copy: llama.cpp's quantizer is not installed"
            continue
        try:
            path = ensure_requantized_copy(args.cache_dir, setup.gguf, mix, llamacpp_venv(args.cache_dir),
                                           args.threads)
            setup.copies[key] = read_copy(path)
        except (InstallError, OSError, ValueError) as error:
            setup.failures[key] = str(error)
            print(f"# {key}: no {mix.name} copy, the comparison is left out: {error}", flush=True)
        else:
            print(f"# {key}: {setup.copies[key].describe()}", flush=True)


def runnable(comparisons: list[Comparison], failures: dict[str, str]) -> list[Comparison]:
    """The comparisons minus peers that could not be installed; one whose requantized copy could not be made
    goes entirely."""
    kept = [c.without(set(failures)) for c in comparisons
            if not any(contender.weights in failures for contender in c.contenders())]
    return [c for c in kept if c.ours is not None or c.peers]


def server_spec(contender: Contender, args: argparse.Namespace, setup: Setup,
                workloads: list[Workload]) -> ServerSpec:
    """How to start `contender` for `workloads` (one workload when it has slots per workload)."""
    port = free_port()
    max_streams = max(w.concurrency for w in workloads)
    # Tokens one request can hold (bench's prompts may re-encode a few tokens longer), rounded up to 256.
    max_request_len = -(-(max(w.input_len + w.output_len for w in workloads) + 64) // 256) * 256
    gguf = setup.gguf_for(contender.weights)
    if contender.engine == "kvpilot":
        spec = kvpilot_server_spec(port, args.threads, kvpilot_weight_args(contender.weights, gguf)
                                   + args.kvpilot_arg)
    elif contender.engine == "llamacpp":
        spec = llamacpp_server_spec(args.cache_dir, gguf, port, args.threads, max_streams, max_request_len,
                                    kv_unified=contender.slots_per_workload and setup.kv_unified)
    elif contender.engine == "llamacpp-py":
        spec = llamacpp_py_server_spec(args.cache_dir, gguf, port, args.threads, max(2048, max_request_len))
    else:
        spec = vllm_server_spec(args.cache_dir, gguf, port, args.threads, max(2048, max_request_len),
                                kv_cache_space_gib=4)
    return ServerSpec(contender.label, spec.command, spec.env, spec.port, spec.ready_path)


def run_contender(contender: Contender, pass_index: int, args: argparse.Namespace, setup: Setup,
                  workloads: list[Workload], results_dir: Path) -> list[Row]:
    """One pass of `contender` over the workloads: one server for all, or one per workload (fair slots)."""
    groups = [[w] for w in workloads] if contender.slots_per_workload else [workloads]
    rows = []
    for group in groups:
        log_name = f"{contender.label}-{pass_index}" + (f"-{group[0].name}" if contender.slots_per_workload else "")
        try:
            rows += run_server(contender.label, pass_index, server_spec(contender, args, setup, group), group,
                               args, results_dir / f"{log_name}-server.log")
        except ServerStartError as error:
            print(f"[{contender.label} pass {pass_index}] did not start: {error}", flush=True)
    return rows


def run_server(label: str, pass_index: int, spec: ServerSpec, workloads: list[Workload],
               args: argparse.Namespace, log_path: Path) -> list[Row]:
    """Starts one server (its output to `log_path`), runs the workloads on it, stops it; a row per workload,
    with the server's peak RSS so far read as the workload ends."""
    rows = []
    started = time.monotonic()
    with running_server(spec, log_path, args.max_start_s) as server:
        print(f"[{label} pass {pass_index}] ready in {time.monotonic() - started:.0f} s at {server.base_url}",
              flush=True)
        for workload in workloads:
            row = measured_row(label, pass_index, server, workload, args, log_path.parent)
            if row is None:
                continue
            rows.append(row)
            print(rows_table([row], {w.name: w for w in workloads})[1], flush=True)
    return rows


def measured_row(label: str, pass_index: int, server: RunningServer, workload: Workload,
                 args: argparse.Namespace, results_dir: Path) -> Row | None:
    """One workload on the running server (None when bench gave no result), with the server's peak RSS."""
    seed = args.seed + args.workloads.index(workload.name)  # the same prompts for every engine
    try:
        row = run_workload(label, pass_index, server.base_url, workload, seed, results_dir)
    except (RuntimeError, OSError, KeyError) as error:
        print(f"[{label} pass {pass_index}] {workload.name}: no result ({error})", flush=True)
        return None
    return replace(row, peak_rss_mib=server.peak_rss_mib())


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
    machine = describe_machine(REPO_ROOT)
    print("\n".join(machine.header_lines()), flush=True)
    comparisons = build_comparisons(args.comparisons, args.engines)
    setup = set_up(args, default_model_path(), comparisons)
    if args.install_only:
        print(f"# set up under {args.cache_dir}; not available: {', '.join(setup.failures) or 'none'}")
        return 1 if setup.failures else 0

    comparisons = runnable(comparisons, setup.failures)
    plan = [contender for c in comparisons for contender in c.sequence(args.passes)]
    sequence = [contender.label for contender in plan]
    workloads = [w for w in default_workloads(args.quick, args.prefill_concurrency, args.input_len,
                                              args.output_len, args.prefill_len) if w.name in args.workloads]
    results_dir = args.cache_dir / "runs" / time.strftime("%Y%m%d-%H%M%S")
    results_dir.mkdir(parents=True, exist_ok=True)
    print_settings(args, sequence, workloads, results_dir)

    rows: list[Row] = []
    print(rows_table([])[0], flush=True)
    for pass_index, contender in enumerate(plan):
        rows += run_contender(contender, pass_index, args, setup, workloads, results_dir)

    report = [line for c in comparisons for line in ["", *comparison_lines(c, sequence, rows, workloads)]]
    report += ["", *memory_lines(sequence, rows, workloads)]
    if setup.vllm_untuned and any(label.startswith("vllm") for label in sequence):
        report += ["", f"# NOTE vllm: {untuned_note(setup.vllm_untuned)}"]
    print("\n" + "\n".join(machine.header_lines()))
    print("\n".join(rows_table(rows, {w.name: w for w in workloads})))
    print("\n".join(report))
    if args.json:
        document = {"machine": asdict(machine), "comparisons": [asdict(c) for c in comparisons],
                    "sequence": sequence, "passes": args.passes, "failures": setup.failures,
                    "requantized_copies": {key: {**asdict(copy), "path": str(copy.path)}
                                           for key, copy in setup.copies.items()},
                    "llama_server_kv_unified": setup.kv_unified, "vllm_untuned": setup.vllm_untuned,
                    "workloads": [asdict(w) for w in workloads],
                    "kvpilot_args": args.kvpilot_arg, "bench_sends_temperature": bench_has_temperature(),
                    "rows": [r.to_json() for r in rows], "report": report}
        args.json.write_text(json.dumps(document, indent=2))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
