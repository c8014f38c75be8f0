"""`kvpilot doctor` beside the "LLM performance doctor" tools on PyPI, on the same staged kvpilot servers:
which tool names the cause planted in each server? (Issue 13; not in CI.)

The peers (inference-profiler, inferpilot, vllm-doctor; peers/doctor_tools.py says what each is) are
installed once, each into its own venv under ~/.cache/kvpilot-peers/doctor-tools/<tool> (reused later); one
that pip cannot install becomes a "not installable: ..." column. Scenarios run one at a time, each on one
`kvpilot serve` (float32, 256 MiB KV pool, 1024-token context unless the scenario changes them) with one
planted cause, stopped with SIGTERM afterwards whatever happened. On that server, in this order:
  1. the passive peers (inferpilot, vllm-doctor: they only read /metrics, so every counter they see is from
     this load), one after another, 45 s into the background load: `kvpilot bench`, 8 streams, prompts of
     ~256 tokens of which 192 are one of two shared prefixes, 32 tokens out; then the load is stopped and
     the server left to go idle;
  2. `kvpilot doctor --url URL --quick --json` (it sends its own probe load);
  3. inference-profiler (its own load: 16 chat requests at concurrency 8).
"Named the planted cause": kvpilot doctor: the expected rule id is its first finding above "low" (the
measured host causes cpu-starvation and client-overload are passed over); a peer: the headline of its
first warning/critical finding matches the scenario's keywords (CAUSE_KEYWORDS). Healthy: no such
finding. The lines under the table show what each verdict was read from; --json keeps everything.

    .venv/bin/python benchmarks/doctor_peers.py                          # all (about 15-20 min on 2 cores)
    .venv/bin/python benchmarks/doctor_peers.py --scenarios queueing,healthy --tools kvpilot,vllm-doctor
    .venv/bin/python benchmarks/doctor_peers.py --json /tmp/doctor-peers.json --timeout-s 300

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
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from peers.doctor_tools import (
    CAUSE_KEYWORDS,
    TOOLS,
    DoctorTool,
    Statement,
    Target,
    ToolOutputError,
    ToolRun,
    checked_subset,
    install_tool,
    judge,
    keyword_matcher,
    run_command,
)
from peers.kvpilot_engine import kvpilot_server_spec
from peers.report import describe_machine
from peers.servers import ServerStartError, free_port, running_server
from peers.venvs import DEFAULT_CACHE_DIR, InstallError

REPO_ROOT = Path(__file__).resolve().parent.parent
KVPILOT = Path(sys.executable).with_name("kvpilot")
BASE = ("--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "1024")
HOST_CAUSES = {"cpu-starvation", "client-overload"}
LOAD_ARGS = ("--dataset", "shared-prefix", "--input-len", "256", "--prefix-len", "192", "--num-prefixes", "2",
             "--num-suffixes", "16", "--output-len", "32", "--ignore-eos", "--temperature", "0",
             "--concurrency", "8", "--duration", "900", "--no-progress", "--no-scrape-metrics")
LOAD_WARMUP_S = 45.0
"""The passive peers start after the load has run this long: vllm-doctor reads lifetime counters (prefix
hits / queries since the server started), which a cold start dominates (15 s gave a 50% hit rate)."""
BUSY_GAUGES = re.compile(r"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? ([0-9.e+]+)$", re.MULTILINE)


@dataclass(frozen=True)
class Scenario:
    name: str
    flags: tuple[str, ...]
    kvpilot_rules: frozenset[str] | None  # the rule ids that name the cause; None: healthy
    cause: str | None  # the CAUSE_KEYWORDS entry for the peers; None: healthy


SCENARIOS = (
    Scenario("queueing", (*BASE, "--max-num-seqs", "1"), frozenset({"queueing"}), "queueing"),
    Scenario("prefix-caching-off", (*BASE, "--no-enable-prefix-caching"),
             frozenset({"prefix-cache-miss", "prefix-caching-off"}), "prefix-caching"),
    Scenario("small-kv-pool", ("--dtype", "float32", "--kv-cache-memory", "24MiB", "--max-model-len", "512"),
             frozenset({"kv-pool-too-small"}), "kv-pool"),
    Scenario("healthy", BASE, None, None),
)
TOOL_NAMES = ("kvpilot", *(tool.name for tool in TOOLS))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(s.name for s in SCENARIOS), help="comma-separated subset")
    parser.add_argument("--tools", default=",".join(TOOL_NAMES), help="comma-separated subset")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="time limit of each tool run")
    parser.add_argument("--max-start-s", type=float, default=300.0, help="longest wait for a server")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="venvs go to <dir>/doctor-tools")
    parser.add_argument("--json", type=Path, help="write commands, exit codes, output tails and verdicts here")
    args = parser.parse_args(argv)
    args.scenarios = checked_subset(parser, "--scenarios", args.scenarios, [s.name for s in SCENARIOS])
    args.tools = checked_subset(parser, "--tools", args.tools, list(TOOL_NAMES))
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


def served_model(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]


def run_kvpilot(scenario: Scenario, target: Target, timeout_s: float) -> ToolRun:
    command = [str(KVPILOT), "doctor", "--url", target.base_url, "--quick", "--json"]
    run, stdout = run_command(command, timeout_s, target.work_dir)
    try:
        findings = json.loads(stdout)["findings"]
    except (json.JSONDecodeError, KeyError):
        return _no_output(run, "no JSON report on stdout")
    run.statements = [Statement(f"{f['severity']} (host cause, passed over)" if f["rule_id"] in HOST_CAUSES
                                else f["severity"], f["rule_id"], f["title"]) for f in findings]
    rules = scenario.kvpilot_rules
    run.cell, run.evidence = judge(run.statements, None if rules is None else rules.__contains__)
    return run


def run_peer(tool: DoctorTool, bin_dir: Path, scenario: Scenario, target: Target, timeout_s: float) -> ToolRun:
    run, stdout = run_command(tool.command(bin_dir, target), timeout_s, target.work_dir)
    try:
        run.statements = tool.read(stdout, target)
    except (ToolOutputError, json.JSONDecodeError, KeyError) as error:
        return _no_output(run, str(error))
    run.cell, run.evidence = judge(run.statements, scenario.cause and keyword_matcher(scenario.cause))
    return run


def _no_output(run: ToolRun, why: str) -> ToolRun:
    last = (run.stderr_tail.strip().splitlines() or run.stdout_tail.strip().splitlines() or [""])[-1]
    run.cell = f"timed out after {run.seconds:.0f} s" if run.timed_out else f"failed (exit {run.exit_code}: {why})"
    run.evidence = last[:200]
    return run


@contextlib.contextmanager
def background_load(base_url: str, log_path: Path):
    """`kvpilot bench` sending the standard load until the block ends (then interrupted, and the server
    left to drain); yields its process."""
    command = [str(KVPILOT), "bench", "--base-url", base_url, *LOAD_ARGS]
    with log_path.open("w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield process
    finally:
        for sig, wait_s in ((signal.SIGINT, 15), (signal.SIGKILL, 5)):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=wait_s)
        wait_idle(base_url)


def wait_idle(base_url: str, max_wait_s: float = 120.0) -> None:
    """Until the server reports no running and no waiting request (or `max_wait_s`)."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(f"{base_url}/metrics", timeout=10).text
            busy = BUSY_GAUGES.findall(text)
            if busy and all(float(value) == 0 for value in busy):
                return
        time.sleep(1.0)


def run_passive(tools: list[DoctorTool], peers: dict, scenario: Scenario, target: Target,
                timeout_s: float) -> dict[str, ToolRun]:
    runs = {}
    with background_load(target.base_url, target.work_dir / "background-load.log") as load:
        time.sleep(LOAD_WARMUP_S)
        for tool in tools:
            if load.poll() is not None:
                runs[tool.name] = ToolRun([], cell=f"not run: background load exited ({load.returncode})")
                continue
            runs[tool.name] = run_peer(tool, Path(peers[tool.name]["bin"]), scenario, target, timeout_s)
            report(scenario, tool.name, runs[tool.name])
    return runs


def run_scenario(scenario: Scenario, args: argparse.Namespace, peers: dict, run_dir: Path) -> dict[str, ToolRun]:
    """Every selected tool against one staged server; {tool: run}, a reason in the cell where it did not run."""
    spec = kvpilot_server_spec(free_port(), os.cpu_count() or 1, list(scenario.flags))
    runnable = [t for t in TOOLS if t.name in args.tools and "bin" in peers.get(t.name, {})]
    runs: dict[str, ToolRun] = {}
    print(f"\n[{scenario.name}] $ {' '.join(spec.command)}", flush=True)
    try:
        with running_server(spec, run_dir / f"{scenario.name}-server.log", args.max_start_s) as server:
            target = Target(server.base_url, served_model(server.base_url), run_dir / scenario.name)
            target.work_dir.mkdir(parents=True, exist_ok=True)
            passive = [t for t in runnable if t.passive]
            if passive:
                runs.update(run_passive(passive, peers, scenario, target, args.timeout_s))
            if "kvpilot" in args.tools:
                runs["kvpilot"] = run_kvpilot(scenario, target, args.timeout_s)
                report(scenario, "kvpilot", runs["kvpilot"])
            for tool in (t for t in runnable if not t.passive):
                runs[tool.name] = run_peer(tool, Path(peers[tool.name]["bin"]), scenario, target, args.timeout_s)
                report(scenario, tool.name, runs[tool.name])
    except (ServerStartError, httpx.HTTPError, OSError) as error:
        print(f"[{scenario.name}] server: {error}", flush=True)
        for name in args.tools:
            runs.setdefault(name, ToolRun([], cell=f"not run: {str(error)[:120]}"))
    for name in args.tools:
        if name not in runs:
            runs[name] = ToolRun([], cell=f"not installable: {peers[name].get('install_error', '?')}")
    return runs


def report(scenario: Scenario, tool: str, run: ToolRun) -> None:
    print(f"[{scenario.name}] {tool}: {run.cell}  (exit {run.exit_code}, {run.seconds:.0f} s; "
          f"first finding: {run.evidence})", flush=True)


def table(results: dict[str, dict[str, ToolRun]], tools: list[str], width: int = 34) -> list[str]:
    def cut(text: str) -> str:
        return text if len(text) <= width else text[:width - 1] + "…"
    lines = [f"{'scenario':<19}" + "".join(f" | {cut(t):<{width}}" for t in tools)]
    lines.append("-" * len(lines[0]))
    for scenario, runs in results.items():
        lines.append(f"{scenario:<19}" + "".join(f" | {cut(runs[t].cell):<{width}}" for t in tools))
    lines.append("\nWhat each verdict was read from (the tool's first warning/critical or above-low finding):")
    for scenario, runs in results.items():
        lines += [f"  {scenario} / {t}: {runs[t].cell} <- {runs[t].evidence}" for t in tools]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so the server's group is stopped too
    args.cache_dir = args.cache_dir.expanduser()
    machine = describe_machine(REPO_ROOT)
    header = machine.header_lines("doctor_peers.py")
    print("\n".join(header), flush=True)
    peers = install_peers(args.tools, args.cache_dir)
    run_dir = args.cache_dir / "doctor-tools" / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"# background load for the passive peers: kvpilot bench {' '.join(LOAD_ARGS)}; files in {run_dir}")
    results = {s.name: run_scenario(s, args, peers, run_dir) for s in SCENARIOS if s.name in args.scenarios}
    print("\n" + "\n".join(header))
    print("\n".join(table(results, args.tools)))
    if args.json:
        document = {"machine": asdict(machine), "tools": peers, "timeout_s": args.timeout_s,
                    "background_load": [str(KVPILOT), "bench", *LOAD_ARGS], "run_dir": str(run_dir),
                    "scenarios": [scenario_json(s, results[s.name]) for s in SCENARIOS if s.name in results]}
        args.json.write_text(json.dumps(document, indent=2))
    return 0


def scenario_json(scenario: Scenario, runs: dict[str, ToolRun]) -> dict:
    return {"name": scenario.name, "server_flags": list(scenario.flags),
            "expected_kvpilot_rules": sorted(scenario.kvpilot_rules or []), "peer_cause": scenario.cause,
            "peer_keywords": CAUSE_KEYWORDS.get(scenario.cause or "", None),
            "runs": {tool: run.to_json() for tool, run in runs.items()}}


if __name__ == "__main__":
    sys.exit(main())
