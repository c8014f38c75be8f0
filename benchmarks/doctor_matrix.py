"""The staged fault matrix (issue #51, item 3): planted faults on kvpilot, vLLM's CPU build and llama.cpp's
llama-server, each diagnosed by `kvpilot doctor --url URL --quick --json`; a confusion table per engine (planted
cause x first finding above LOW) and a JSON result. Not in CI.

Each fault (peers/fault_matrix.py: FAULTS) is a server configuration per engine (flags over that engine's healthy
base command; "n/a" where the engine cannot express the fault) plus what is staged around the server
(tests/doctor/fault_staging.py, shared with the doctor's live tests): other users' traffic, busy loops pinned to the
server's cores, a delaying proxy, a doctor whose own process stalls. Engines run one after another and one server
at a time (peers/servers.py stops each before the next starts); the doctor runs `--repeats` times against each
staged server, each run a `kvpilot doctor` process of its own (its own process group; with `--placement split`
pinned to a core the server does not get).

    .venv/bin/python benchmarks/doctor_matrix.py --smoke                     # 2 faults on kvpilot, ~1 min
    .venv/bin/python benchmarks/doctor_matrix.py --engines kvpilot --repeats 1 --json /tmp/matrix.json
    .venv/bin/python benchmarks/doctor_matrix.py --repeats 3 --json /tmp/matrix.json   # every engine (quiet box)
    .venv/bin/python benchmarks/doctor_matrix.py --engines kvpilot,vllm --faults one-slot,prefix-caching-off --verify

vLLM and llama.cpp come from their venvs under ~/.cache/kvpilot-peers (peers/install.py, as peers_cpu.py installs
them: reused when there). Run it on a quiet machine: the doctor reports other processes' CPU use as a cause
(cpu-starvation), and the "past host" column says what the doctor named behind it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from peers.doctor_tools import checked_subset, run_command, stop_group
from peers.fault_matrix import (ENGINES, FAULT_NAMES, FAULTS, SMOKE_FAULTS, VERIFY_ENGINES, EngineSetup, Fault,
                                Load, Row, confusion_json, confusion_lines, first_finding, first_past_host, is_right,
                                serve_command_line, server_spec)
from peers.install import install_peers
from peers.report import describe_machine
from peers.servers import ServerStartError, free_port, running_server
from peers.venvs import DEFAULT_CACHE_DIR

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # tests/doctor/fault_staging.py: the staging the live tests use too
from tests.doctor.fault_staging import (DelayProxy, background_load_command, hogged_cli,  # noqa: E402
                                        spinners)

from kvpilot.model.default_model import default_model_path  # noqa: E402

KVPILOT = Path(sys.executable).with_name("kvpilot")
PEER_ENGINE = {"vllm": "vllm", "llamacpp": "llamacpp"}  # matrix engine -> peers/install.py engine
MIN_DELAY_S, MAX_DELAY_S = 0.05, 2.0
"""Bounds of the proxy delay and the client stall sized from the server's TTFT."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {','.join(ENGINES)}")
    parser.add_argument("--faults", default=",".join(FAULT_NAMES), help=f"comma-separated, from {','.join(FAULT_NAMES)}")
    parser.add_argument("--repeats", type=int, default=3, help="doctor runs against each staged server")
    parser.add_argument("--smoke", action="store_true",
                        help=f"{' and '.join(SMOKE_FAULTS)} on kvpilot, once, with 2-second phases and at most 4 in "
                             "flight (about a minute)")
    parser.add_argument("--verify", action="store_true", help="also `kvpilot doctor --serve CMD --verify --quick` on "
                        "each kvpilot / vLLM fault whose staging is the server's flags and traffic: before/after")
    parser.add_argument("--placement", choices=("shared", "split"), default="shared",
                        help="shared: server, doctor and staging on every core; split: the server (and the busy "
                             "loops) on all cores but the last, the doctor and the background load on the last")
    parser.add_argument("--phase-seconds", type=float, help="passed to kvpilot doctor (default: --quick's)")
    parser.add_argument("--max-concurrency", type=int, help="passed to kvpilot doctor (default: --quick's 8)")
    parser.add_argument("--threads", type=int, help="server threads (default: the server's cores)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="time limit of each doctor run")
    parser.add_argument("--max-start-s", type=float, default=600.0, help="longest wait for a server")
    parser.add_argument("--verify-budget", type=float, default=600.0, help="--verify-budget of each verify run")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="peers' venvs; runs/ go here")
    parser.add_argument("--json", type=Path, help="write the setup, every run and the confusion tables here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.engines, args.faults, args.repeats = "kvpilot", ",".join(SMOKE_FAULTS), 1
        args.phase_seconds = args.phase_seconds or 2.0
        args.max_concurrency = args.max_concurrency or 4
    args.engines = checked_subset(parser, "--engines", args.engines, list(ENGINES))
    args.faults = checked_subset(parser, "--faults", args.faults, list(FAULT_NAMES))
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.placement == "split" and (os.cpu_count() or 1) < 2:
        parser.error("--placement split needs at least 2 cores")
    args.cache_dir = args.cache_dir.expanduser()
    return args



@dataclass(frozen=True)
class Placement:
    """Cores of the server (and its busy loops) and of the clients (the doctor, the background load); None:
    unpinned, every core."""

    server_cpus: tuple[int, ...] | None
    client_cpus: tuple[int, ...] | None

    @staticmethod
    def of(name: str) -> Placement:
        cpus = tuple(range(os.cpu_count() or 1))
        return Placement(cpus[:-1], cpus[-1:]) if name == "split" else Placement(None, None)

    def client_prefix(self) -> list[str]:
        return ["taskset", "-c", ",".join(map(str, self.client_cpus))] if self.client_cpus else []

    def spinner_cpus(self) -> list[int]:
        return list(self.server_cpus or range(os.cpu_count() or 1))


def probe_flags(args: argparse.Namespace) -> list[str]:
    out = ["--phase-seconds", f"{args.phase_seconds:g}"] if args.phase_seconds else []
    return out + (["--max-concurrency", str(args.max_concurrency)] if args.max_concurrency else [])


# ---- staging around the server ------------------------------------------------------------------------------

@dataclass
class Staged:
    """Where the doctor probes, the argv that runs the kvpilot CLI, and what the staging measured or started."""

    url: str
    cli: list[str]
    notes: dict[str, object] = field(default_factory=dict)


def served_model(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"])


def _streamed_ttft_s(url: str, body: dict) -> float | None:
    started, first = time.perf_counter(), None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():  # read to the end: the next round finds the server idle
            if first is None and line.startswith("data:") and "[DONE]" not in line:
                first = time.perf_counter() - started
    return first


def measure_ttft_s(url: str, concurrency: int = 4, rounds: int = 3) -> float:
    """Median TTFT of 64-word streamed completions, ``concurrency`` at a time, after a first round that warms the
    server up: the scale of the delays to plant. Under load, as most of the quick probe's requests are: sized from
    a request alone (~0.1 s on a busy box), a proxy's delay was a small share of the probe's median TTFT and
    `network-overhead` stayed quiet."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    body = {"model": served_model(url), "prompt": "the first time of the world " * 10 + "city school",
            "max_tokens": 8, "stream": True, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(concurrency) as pool:
        measured = [list(pool.map(lambda _: _streamed_ttft_s(url, body), range(concurrency))) for _ in range(rounds)]
    ttfts = [t for batch in measured[1:] for t in batch if t is not None]
    if not ttfts:
        raise httpx.HTTPError(f"{url}: no streamed token in {concurrency * (rounds - 1)} completions")
    return statistics.median(ttfts)


@contextlib.contextmanager
def load_process(url: str, load: Load, log_path: Path, placement: Placement,
                 notes: dict[str, object]) -> Iterator[None]:
    """tests/doctor/fault_staging's background load in a process (group) of its own until the block ends; its
    counts go to ``notes["background_load"]``."""
    command = [*placement.client_prefix(), *background_load_command(url, load.concurrency, load.prompt_words,
                                                                   load.max_tokens, load.pause_s)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                   cwd=REPO_ROOT)
    try:
        yield
    finally:
        stop_group(process, signal.SIGTERM)
        lines = [ln for ln in log_path.read_text().splitlines() if ln.startswith("background load:")]
        notes["background_load"] = lines[-1] if lines else f"no summary (exit {process.returncode}); see {log_path}"


@contextlib.contextmanager
def staged(fault: Fault, server_url: str, port: int, placement: Placement, log_dir: Path) -> Iterator[Staged]:
    """Everything the fault plants around the running server, undone on exit (in reverse)."""
    stage = Staged(server_url, [*placement.client_prefix(), str(KVPILOT)])
    with contextlib.ExitStack() as stack:
        if fault.proxy_delay_ttfts or fault.client_stall_ttfts:
            stage.notes["server_ttft_s"] = ttft = round(measure_ttft_s(server_url), 4)
        if fault.load is not None:
            stack.enter_context(load_process(server_url, fault.load, log_dir / f"{fault.name}-load.log", placement,
                                             stage.notes))
            time.sleep(fault.load.warmup_s)
        if fault.spinners:
            cpus = placement.spinner_cpus()
            stage.notes["spinner_pids"] = stack.enter_context(spinners(len(cpus), cpus))
            stage.notes["spinner_cpus"] = cpus
        if fault.proxy_delay_ttfts:
            delay = min(MAX_DELAY_S, max(MIN_DELAY_S, fault.proxy_delay_ttfts * ttft))
            stage.url = stack.enter_context(DelayProxy(port, delay)).url
            stage.notes["proxy_delay_s"] = round(delay, 4)
        if fault.client_stall_ttfts:
            interval = min(MAX_DELAY_S, max(MIN_DELAY_S, fault.client_stall_ttfts * ttft))
            stage.cli = [*placement.client_prefix(), *hogged_cli(interval)]
            stage.notes["client_stall_s"] = round(interval, 4)
        yield stage


# ---- doctor runs --------------------------------------------------------------------------------------------

def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def doctor_run(fault: Fault, stage: Staged, args: argparse.Namespace, work_dir: Path, report: Path) -> dict:
    """One `kvpilot doctor --url ... --quick --json` in its own process group: the record kept in the JSON. The
    doctor's whole report (every finding's evidence) is kept in `report`."""
    command = [*stage.cli, "doctor", "--url", stage.url, "--quick", "--json", *probe_flags(args)]
    run, stdout = run_command(command, args.timeout_s, work_dir)
    report.write_text(stdout)
    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError:
        doc = None
    record = {"command": command, "exit_code": run.exit_code, "seconds": run.seconds, "timed_out": run.timed_out,
              "first": first_finding(doc), "first_past_host": first_past_host(doc, fault), "report": str(report)}
    if doc is None:
        return {**record, "stderr_tail": _tail(run.stderr_tail, 12)}
    resources = doc.get("resources") or {}
    probe = doc.get("probe") or {}
    return {**record, "findings": [[f["rule_id"], f["severity"]] for f in doc["findings"]],
            "engine": doc.get("engine"), "verdict": doc.get("verdict"), "probe_wall_s": probe.get("wall_s"),
            "probe_notes": probe.get("notes"), "run_queue_share": resources.get("run_queue_share"),
            "other_cores": resources.get("other_cores"), "load_avg_1m": resources.get("load_avg_1m"),
            "top_finding_summary": doc["findings"][0]["summary"] if doc["findings"] else None,
            "latency_split_ms": doc.get("latency_split_ms")}


def verify_run(engine: str, fault: Fault, setup: EngineSetup, args: argparse.Namespace, placement: Placement,
               run_dir: Path) -> dict:
    """`kvpilot doctor --serve CMD --verify --quick --json` on the fault's server (a fixed port, so its background
    load follows the restarts; not pinned: the doctor must still see `vllm serve` in the command)."""
    spec = server_spec(engine, fault, setup, free_port(), pin=False)
    command = [*placement.client_prefix(), str(KVPILOT), "doctor", "--serve", serve_command_line(spec), "--verify",
               "--quick", "--json", "--verify-budget", f"{args.verify_budget:g}", "--serve-timeout",
               f"{args.max_start_s:g}", *probe_flags(args)]
    notes: dict[str, object] = {}
    print(f"[{engine} / {fault.name}] verify: $ {' '.join(command[:4])} ... --verify", flush=True)
    with (load_process(spec.base_url, fault.load, run_dir / f"{engine}-{fault.name}-verify-load.log", placement, notes)
          if fault.load is not None else contextlib.nullcontext()):
        run, stdout = run_command(command, args.verify_budget + 2 * args.max_start_s + 300, run_dir / engine)
    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError:
        return {"command": command, "exit_code": run.exit_code, "seconds": run.seconds, **notes,
                "stderr_tail": _tail(run.stderr_tail, 12)}
    return {"command": command, "exit_code": run.exit_code, "seconds": run.seconds, **notes,
            "first": first_finding(doc), "verify": doc.get("verify")}


def verify_lines(engine: str, fault: Fault, result: dict) -> list[str]:
    """Before/after lines of a verify run, as `kvpilot doctor --verify` prints them."""
    verify = result.get("verify")
    if not verify:
        return [f"  {fault.name}: no verify result (exit {result.get('exit_code')}): "
                f"{(result.get('stderr_tail') or '').splitlines()[-1:]}"]
    lines = [f"  {fault.name}: first finding {result['first']}; {verify['stopped']}"]
    for t in verify["trials"]:
        change = f" ({t['change']:+.0%})" if t.get("change") is not None else ""
        before = "n/a" if t["before"] is None else f"{t['before']:,.1f}"
        after = "n/a" if t["after"] is None else f"{t['after']:,.1f}"
        probes = ", means of 2 probes" if t.get("probes", 1) > 1 else ""
        lines.append(f"    {' '.join(t['flags'])} ({t['rule_id']}): {t['metric']} {before} -> {after}{change}{probes}; "
                     f"{'kept' if t['kept'] else 'withdrawn'} ({t['wall_s']:.0f} s)")
    return lines


# ---- one cell, one engine -----------------------------------------------------------------------------------

def run_cell(engine: str, fault: Fault, setup: EngineSetup, args: argparse.Namespace, placement: Placement,
             unavailable: dict[str, str], run_dir: Path) -> tuple[Row, dict]:
    """The fault on the engine: its server started, staged, diagnosed `--repeats` times, stopped; (row, JSON)."""
    cell = fault.cell(engine)
    if cell.na is not None:
        return Row(fault, status=f"n/a: {cell.na}"), {"status": "n/a", "why": cell.na}
    if engine in unavailable:
        why = f"not installable: {unavailable[engine].splitlines()[0][:160]}"
        return Row(fault, status=why), {"status": why}
    spec = server_spec(engine, fault, setup, free_port())
    out: dict = {"status": "ran", "server": {"command": spec.command, "env": spec.env}, "flags": list(cell.flags),
                 "staging": fault.staging(), "expected": sorted(fault.expected), "runs": []}
    print(f"\n[{engine} / {fault.name}] {fault.planted}\n  $ {' '.join(spec.command)}", flush=True)
    row = Row(fault)
    try:
        with running_server(spec, run_dir / f"{engine}-{fault.name}-server.log", args.max_start_s) as server, \
                staged(fault, server.base_url, spec.port, placement, run_dir) as stage:
            out["staged"] = stage.notes
            for i in range(args.repeats):
                record = doctor_run(fault, stage, args, run_dir / engine,
                                    run_dir / f"{engine}-{fault.name}-doctor-{i + 1}.json")
                out["runs"].append(record)
                row.firsts.append(record["first"])
                row.past_host.append(record["first_past_host"])
                print(_run_line(engine, fault, i, args.repeats, record), flush=True)
    except (ServerStartError, httpx.HTTPError, OSError) as error:
        out["status"] = row.status = f"not run: {str(error)[:200]}"
        print(f"[{engine} / {fault.name}] {row.status}", flush=True)
    if args.verify and fault.verifiable and engine in VERIFY_ENGINES and not row.status:
        out["verify"] = verify_run(engine, fault, setup, args, placement, run_dir)
        print("\n".join(verify_lines(engine, fault, out["verify"])), flush=True)
    return row, out


def _run_line(engine: str, fault: Fault, index: int, repeats: int, record: dict) -> str:
    verdict = "right" if is_right(fault, record["first"]) else "WRONG"
    ranked = ", ".join(f"{rule} {sev}" for rule, sev in record.get("findings", [])) or "no findings"
    past = "" if record["first_past_host"] == record["first"] else f" (past host causes: {record['first_past_host']})"
    return (f"[{engine} / {fault.name}] run {index + 1}/{repeats}: first {record['first']} {verdict}{past}; "
            f"{ranked}; exit {record['exit_code']}, {record['seconds']:.0f} s")


def engine_setup(args: argparse.Namespace, placement: Placement) -> EngineSetup:
    threads = args.threads or len(placement.server_cpus or range(os.cpu_count() or 1))
    return EngineSetup(args.cache_dir, default_model_path(), threads, placement.server_cpus)


def set_up_peers(args: argparse.Namespace, setup: EngineSetup) -> dict[str, str]:
    """{engine: why it cannot run} after installing (or finding installed) the peers selected."""
    peers = [PEER_ENGINE[e] for e in args.engines if e in PEER_ENGINE]
    failures = install_peers(peers, args.cache_dir, setup.gguf, num_build_jobs=os.cpu_count() or 1) if peers else {}
    return {engine: failures[PEER_ENGINE[engine]] for engine in args.engines
            if PEER_ENGINE.get(engine) in failures}


def fault_json(fault: Fault) -> dict:
    return {"name": fault.name, "planted": fault.planted, "expected": sorted(fault.expected),
            "staging": fault.staging(), "verifiable": fault.verifiable,
            "cells": {e: ({"na": c.na} if c.na else {"flags": list(c.flags)}) for e, c in fault.cells.items()}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: servers, loads and spinners are stopped
    started = time.monotonic()
    placement = Placement.of(args.placement)
    setup = engine_setup(args, placement)
    machine = describe_machine(REPO_ROOT)
    header = machine.header_lines("doctor_matrix.py") + [
        f"# load average at start {os.getloadavg()[0]:.1f}; placement {args.placement}; repeats {args.repeats}; "
        f"doctor: kvpilot doctor --url URL --quick --json {' '.join(probe_flags(args))}".rstrip()]
    print("\n".join(header), flush=True)
    unavailable = set_up_peers(args, setup)
    run_dir = args.cache_dir / "doctor-matrix" / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"# server logs, background-load logs, doctor reports and working dirs in {run_dir}", flush=True)
    faults = [f for f in FAULTS if f.name in args.faults]
    tables, engines_json = [], {}
    for engine in args.engines:
        rows, cells = [], {}
        for fault in faults:
            row, cells[fault.name] = run_cell(engine, fault, setup, args, placement, unavailable, run_dir)
            rows.append(row)
        tables.append(confusion_lines(engine, rows))
        engines_json[engine] = {"cells": cells, "confusion": confusion_json(rows)}
    print("\n" + "\n".join(header))
    print(f"# finished in {time.monotonic() - started:.0f} s; load average now {os.getloadavg()[0]:.1f}")
    for lines in tables:
        print("\n" + "\n".join(lines))
    for engine, doc in engines_json.items():
        verified = [(f, doc["cells"][f.name]["verify"]) for f in faults if "verify" in doc["cells"].get(f.name, {})]
        if verified:
            print(f"\n{engine}: verify (kvpilot doctor --serve CMD --verify --quick)")
            print("\n".join(line for f, result in verified for line in verify_lines(engine, f, result)))
    if args.json:
        document = {"machine": asdict(machine), "wall_s": round(time.monotonic() - started, 1),
                    "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "setup": {**asdict(setup), "cache_dir": str(setup.cache_dir), "gguf": str(setup.gguf)},
                    "run_dir": str(run_dir), "faults": [fault_json(f) for f in faults], "engines": engines_json}
        args.json.write_text(json.dumps(document, indent=1, default=str))
        print(f"\n# JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
