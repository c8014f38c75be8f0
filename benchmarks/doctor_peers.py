"""`kvpilot doctor` beside the "LLM performance doctor" tools on PyPI, on the staged fault matrix of
`benchmarks/doctor_matrix.py`: which tool names the cause planted in each server? (Issues 13 and 51; not in CI.)

The peers (inference-profiler, inferpilot, vllm-doctor; peers/doctor_tools.py says what each is) are
installed once, each into its own venv under ~/.cache/kvpilot-peers/doctor-tools/<tool> (reused later); one
that pip cannot install becomes a "not installable: ..." column. Each fault of peers/fault_matrix.FAULTS runs on
each engine chosen (kvpilot, vLLM's CPU build, llama.cpp's llama-server), one server at a time, started and
staged exactly as the matrix does it (the fault's flags, other users' traffic, busy loops, a delaying proxy, a
stalling client), and stopped afterwards whatever happened. On that staged server, in this order:
  1. the passive peers (inferpilot, vllm-doctor: they only read /metrics), one after another, 45 s into the
     peers' load: `kvpilot bench` through the staged URL, 8 streams, prompts of 192 tokens of which 144 are one
     of two shared prefixes, 32 tokens out (beside gil stalls where the fault is a slow client); then the load is
     stopped and its requests left to drain;
  2. `kvpilot doctor --url URL --quick --json`, as the matrix runs it (its own probe load);
  3. inference-profiler (its own load: 16 chat requests at concurrency 8).
"Named the planted cause": kvpilot doctor: its first finding above LOW is one of the fault's rule ids (strict:
no finding is passed over); a peer: the headline of its first warning/critical finding matches the fault's
keywords (PEER_CAUSES -> doctor_tools.CAUSE_KEYWORDS). Healthy: no such finding. Under each engine's table,
per peer: the faults kvpilot named and the peer did not, and the reverse (issue 51 asks for none of those).

    .venv/bin/python benchmarks/doctor_peers.py --engines kvpilot --json /tmp/doctor-peers.json   # ~35 min
    .venv/bin/python benchmarks/doctor_peers.py --engines kvpilot,vllm --faults one-slot,healthy \
        --tools kvpilot,vllm-doctor

Run it on a quiet machine: kvpilot doctor reports other processes' CPU use as a cause (cpu-starvation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import httpx
from doctor_matrix import (Placement, Staged, doctor_run, engine_setup, fault_json, served_model, set_up_peers,
                           staged)
from peers.doctor_tools import (CAUSE_KEYWORDS, TOOLS, DoctorTool, Statement, Target, ToolOutputError, ToolRun,
                                checked_subset, install_tool, judge, keyword_matcher, run_command, stop_group)
from peers.fault_matrix import ENGINES, FAULT_NAMES, FAULTS, EngineSetup, Fault, server_spec
from peers.report import describe_machine
from peers.servers import ServerStartError, free_port, running_server
from peers.venvs import DEFAULT_CACHE_DIR, InstallError

from tests.doctor.fault_staging import stalled_cli

REPO_ROOT = Path(__file__).resolve().parent.parent
KVPILOT = Path(sys.executable).with_name("kvpilot")
LOAD_ARGS = ("--dataset", "shared-prefix", "--input-len", "192", "--prefix-len", "144", "--num-prefixes", "2",
             "--num-suffixes", "16", "--output-len", "32", "--ignore-eos", "--temperature", "0",
             "--concurrency", "8", "--duration", "900", "--no-progress", "--no-scrape-metrics")
"""The peers' load: 224 tokens a request, inside the smallest context of the matrix (tiny-kv-pool's 256)."""
LOAD_WARMUP_S = 45.0
"""The passive peers start after the load has run this long: vllm-doctor reads lifetime counters (prefix
hits / queries since the server started), which a cold start dominates (15 s gave a 50% hit rate)."""
BUSY_GAUGES = re.compile(r"^(?:vllm:num_requests_(?:running|waiting)|llamacpp:requests_(?:processing|deferred))"
                         r"(?:\{[^}]*\})? ([0-9.e+]+)$", re.MULTILINE)
PEER_CAUSES = {
    "too-few-seqs": "queueing", "one-slot": "queueing", "overloaded-queue": "queueing",
    "no-cont-batching": "static-batching", "tiny-kv-pool": "kv-pool", "max-len-over-pool": "kv-pool",
    "prefix-caching-off": "prefix-caching", "long-prompts": "long-prompts", "cpu-starvation": "cpu-starvation",
    "slow-network": "network", "slow-client": "client",
}
"""Each planted fault's CAUSE_KEYWORDS entry (a healthy server has none)."""
TOOL_NAMES = ("kvpilot", *(tool.name for tool in TOOLS))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="kvpilot", help=f"comma-separated, from {','.join(ENGINES)}")
    parser.add_argument("--faults", default=",".join(FAULT_NAMES), help="comma-separated subset")
    parser.add_argument("--tools", default=",".join(TOOL_NAMES), help="comma-separated subset")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="time limit of each tool run")
    parser.add_argument("--max-start-s", type=float, default=600.0, help="longest wait for a server")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="venvs go to <dir>/doctor-tools")
    parser.add_argument("--json", type=Path, help="write commands, exit codes, output tails and verdicts here")
    args = parser.parse_args(argv)
    args.engines = checked_subset(parser, "--engines", args.engines, list(ENGINES))
    args.faults = checked_subset(parser, "--faults", args.faults, list(FAULT_NAMES))
    args.tools = checked_subset(parser, "--tools", args.tools, list(TOOL_NAMES))
    args.cache_dir = args.cache_dir.expanduser()
    args.threads = args.phase_seconds = args.max_concurrency = None  # doctor_matrix's defaults
    return args


def install_peers(names: list[str], cache_dir: Path) -> dict[str, dict]:
    """{tool: requirement, version, venv bin/ or install_error} for the selected peers."""
    found = {}
    for tool in (t for t in TOOLS if t.name in names):
        try:
            venv, version = install_tool(tool, cache_dir / "doctor-tools")
            found[tool.name] = {"requirement": tool.requirement, "version": version, "bin": str(venv.bin_dir)}
        except (InstallError, OSError) as error:
            found[tool.name] = {"requirement": tool.requirement, "install_error": str(error).splitlines()[0]}
        print(f"# {tool.name}: {found[tool.name].get('version') or found[tool.name]['install_error']}", flush=True)
    return found


# ---- the tools on one staged server -------------------------------------------------------------------------

def peer_matcher(fault: Fault):
    """None for a healthy server (no finding is right), else whether a headline names the planted cause."""
    return None if fault.healthy else keyword_matcher(PEER_CAUSES[fault.name])


def run_kvpilot(fault: Fault, stage: Staged, args: argparse.Namespace, work_dir: Path) -> ToolRun:
    """One `kvpilot doctor --quick` as doctor_matrix.py runs it, judged strictly by its first finding above LOW."""
    record = doctor_run(fault, stage, args, work_dir, work_dir / "kvpilot-doctor.json")
    run = ToolRun(record["command"], record["exit_code"], record["seconds"], record["timed_out"],
                  stderr_tail=record.get("stderr_tail", ""))
    if "findings" not in record:
        return _no_output(run, "no JSON report on stdout")
    top = record.get("top_finding_summary") or ""  # the summary of the report's first finding only
    run.statements = [Statement(severity, rule_id, top if i == 0 else "")
                      for i, (rule_id, severity) in enumerate(record["findings"])]
    run.cell, run.evidence = judge(run.statements, None if fault.healthy else fault.expected.__contains__)
    return run


def run_peer(tool: DoctorTool, bin_dir: Path, fault: Fault, target: Target, timeout_s: float) -> ToolRun:
    run, stdout = run_command(tool.command(bin_dir, target), timeout_s, target.work_dir)
    try:
        run.statements = tool.read(stdout, target)
    except (ToolOutputError, json.JSONDecodeError, KeyError) as error:
        return _no_output(run, str(error))
    run.cell, run.evidence = judge(run.statements, peer_matcher(fault))
    return run


def _no_output(run: ToolRun, why: str) -> ToolRun:
    last = (run.stderr_tail.strip().splitlines() or run.stdout_tail.strip().splitlines() or [""])[-1]
    run.cell = f"timed out after {run.seconds:.0f} s" if run.timed_out else f"failed (exit {run.exit_code}: {why})"
    run.evidence = last[:200]
    return run


@contextlib.contextmanager
def peers_load(fault: Fault, stage: Staged, log_path: Path) -> Iterator[subprocess.Popen]:
    """`kvpilot bench` sending the peers' load through the staged URL until the block ends (then interrupted, and
    its requests left to drain); a slow-client fault's stalls run beside it for the whole run."""
    cli = [str(KVPILOT)]
    if "client_stall_s" in stage.notes:
        cli = stalled_cli(float(stage.notes["client_stall_s"]))  # type: ignore[arg-type]
    command = [*cli, "bench", "--base-url", stage.url, *LOAD_ARGS]
    with log_path.open("w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO_ROOT)
    try:
        yield process
    finally:
        stop_group(process, signal.SIGINT)  # bench prints its summary on an interrupt
        wait_drained(stage.url, fault.load.concurrency if fault.load else 0)


def wait_drained(base_url: str, staged_in_flight: int, max_wait_s: float = 120.0) -> None:
    """Until the server's running + waiting gauges fall to what the fault's own traffic keeps in flight (or
    `max_wait_s`; at once where the server exports neither vLLM's nor llama.cpp's gauges)."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            busy = BUSY_GAUGES.findall(httpx.get(f"{base_url}/metrics", timeout=10).text)
            if not busy or sum(float(value) for value in busy) <= staged_in_flight:
                return
        time.sleep(1.0)


def run_passive(tools: list[DoctorTool], peers: dict, fault: Fault, stage: Staged, target: Target,
                timeout_s: float) -> dict[str, ToolRun]:
    runs = {}
    with peers_load(fault, stage, target.work_dir / "peers-load.log") as load:
        time.sleep(LOAD_WARMUP_S)
        for tool in tools:
            if load.poll() is not None:
                runs[tool.name] = ToolRun([], cell=f"not run: the peers' load exited ({load.returncode})")
                continue
            runs[tool.name] = run_peer(tool, Path(peers[tool.name]["bin"]), fault, target, timeout_s)
    return runs


def run_cell(engine: str, fault: Fault, setup: EngineSetup, args: argparse.Namespace, peers: dict,
             unavailable: dict[str, str], run_dir: Path) -> dict[str, ToolRun]:
    """Every selected tool against the fault's staged server on ``engine``; {tool: run}, the reason in the cell
    where it did not run."""
    cell = fault.cell(engine)
    why_not = (f"n/a: {cell.na}" if cell.na else f"not installable: {unavailable[engine].splitlines()[0][:120]}"
               if engine in unavailable else None)
    if why_not:
        return {name: ToolRun([], cell=why_not) for name in args.tools}
    spec = server_spec(engine, fault, setup, free_port())
    runnable = [t for t in TOOLS if t.name in args.tools and "bin" in peers.get(t.name, {})]
    runs: dict[str, ToolRun] = {}
    work_dir = run_dir / engine / fault.name
    work_dir.mkdir(parents=True, exist_ok=True)
    print(f"\n[{engine} / {fault.name}] {fault.planted}\n  $ {' '.join(spec.command)}", flush=True)
    try:
        with running_server(spec, work_dir / "server.log", args.max_start_s) as server, \
                staged(fault, server.base_url, spec.port, Placement(None, None), work_dir) as stage:
            target = Target(stage.url, served_model(server.base_url), work_dir)
            passive = [t for t in runnable if t.passive]
            if passive:
                runs.update(run_passive(passive, peers, fault, stage, target, args.timeout_s))
            if "kvpilot" in args.tools:
                runs["kvpilot"] = run_kvpilot(fault, stage, args, work_dir)
            for tool in (t for t in runnable if not t.passive):
                runs[tool.name] = run_peer(tool, Path(peers[tool.name]["bin"]), fault, target, args.timeout_s)
    except (ServerStartError, httpx.HTTPError, OSError) as error:
        print(f"[{engine} / {fault.name}] server: {error}", flush=True)
        for name in args.tools:
            runs.setdefault(name, ToolRun([], cell=f"not run: {str(error)[:120]}"))
    for name in args.tools:
        if name not in runs:
            runs[name] = ToolRun([], cell=f"not installable: {peers[name].get('install_error', '?')}")
        print(f"[{engine} / {fault.name}] {name}: {runs[name].cell}  (exit {runs[name].exit_code}, "
              f"{runs[name].seconds:.0f} s; first finding: {runs[name].evidence})", flush=True)
    return runs


# ---- the report ---------------------------------------------------------------------------------------------

def named(run: ToolRun) -> bool | None:
    """Whether the tool named the planted cause (healthy: said nothing); None where it did not run."""
    if run.cell == "yes":
        return True
    return False if run.cell.startswith("no (") else None  # not "not run: ..." nor "not installable"


def table(results: dict[str, dict[str, ToolRun]], tools: list[str], width: int = 30) -> list[str]:
    def cut(text: str) -> str:
        return text if len(text) <= width else text[:width - 1] + "…"
    lines = [f"{'planted fault':<19}" + "".join(f" | {cut(t):<{width}}" for t in tools)]
    lines.append("-" * len(lines[0]))
    for fault, runs in results.items():
        lines.append(f"{fault:<19}" + "".join(f" | {cut(runs[t].cell):<{width}}" for t in tools))
    return lines


def against_peers(results: dict[str, dict[str, ToolRun]], tools: list[str]) -> list[str]:
    """Per peer, over the faults both ran on: kvpilot right where the peer is wrong, and the reverse."""
    lines = []
    for peer in (t for t in tools if t != "kvpilot"):
        both = {f: (named(r["kvpilot"]), named(r[peer])) for f, r in results.items()
                if named(r["kvpilot"]) is not None and named(r[peer]) is not None}
        ahead = [f for f, (k, p) in both.items() if k and not p]
        behind = [f for f, (k, p) in both.items() if p and not k]
        lines.append(f"  kvpilot vs {peer} on {len(both)} faults: both right {sum(k and p for k, p in both.values())}, "
                     f"only kvpilot {len(ahead)} ({', '.join(ahead) or '-'}), only {peer} {len(behind)} "
                     f"({', '.join(behind) or '-'}), both wrong {sum(not k and not p for k, p in both.values())}")
    return lines


def evidence_lines(results: dict[str, dict[str, ToolRun]], tools: list[str]) -> list[str]:
    return [f"  {fault} / {t}: {runs[t].cell} <- {runs[t].evidence}" for fault, runs in results.items() for t in tools]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: servers, loads and spinners are stopped
    started = time.monotonic()
    placement = Placement(None, None)
    setup = engine_setup(args, placement)
    machine = describe_machine(REPO_ROOT)
    header = machine.header_lines("doctor_peers.py") + [
        f"# load average at start {os.getloadavg()[0]:.1f}; peers' load: kvpilot bench {' '.join(LOAD_ARGS)}"]
    print("\n".join(header), flush=True)
    peers = install_peers(args.tools, args.cache_dir)
    unavailable = set_up_peers(args, setup)
    run_dir = args.cache_dir / "doctor-tools" / "runs" / time.strftime("%Y%m%d-%H%M%S")
    print(f"# server logs, loads, tool outputs in {run_dir}", flush=True)
    faults = [f for f in FAULTS if f.name in args.faults]
    results = {engine: {f.name: run_cell(engine, f, setup, args, peers, unavailable, run_dir) for f in faults}
               for engine in args.engines}
    print("\n" + "\n".join(header))
    print(f"# finished in {time.monotonic() - started:.0f} s; load average now {os.getloadavg()[0]:.1f}")
    for engine, by_fault in results.items():
        print(f"\n{engine}: did each tool name the planted cause? (healthy: yes = no finding)")
        print("\n".join(table(by_fault, args.tools) + against_peers(by_fault, args.tools)))
    for engine, by_fault in results.items():
        print(f"\n{engine}: what each verdict was read from (the first warning/critical or above-LOW finding)")
        print("\n".join(evidence_lines(by_fault, args.tools)))
    if args.json:
        document = {"machine": asdict(machine), "wall_s": round(time.monotonic() - started, 1), "tools": peers,
                    "timeout_s": args.timeout_s, "peers_load": [str(KVPILOT), "bench", *LOAD_ARGS],
                    "run_dir": str(run_dir), "faults": [fault_json(f) for f in faults],
                    "peer_keywords": {f.name: CAUSE_KEYWORDS[PEER_CAUSES[f.name]] for f in faults if not f.healthy},
                    "engines": {e: {f: {t: r.to_json() for t, r in runs.items()} for f, runs in by_fault.items()}
                                for e, by_fault in results.items()}}
        args.json.write_text(json.dumps(document, indent=1, default=str))
        print(f"\n# JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
