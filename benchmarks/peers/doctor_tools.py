"""The peer "LLM performance doctor" tools of `benchmarks/doctor_peers.py`: what each is, its own virtual
environment, how it is run against a staged kvpilot server, how its output becomes ranked statements, and
the keyword rules that decide whether it named the planted cause.

What each tool is (read from its PyPI wheel; none needs a GPU or vLLM for the mode used here):
- inference-profiler 0.1.0: an active load generator. `inference-profiler profile --endpoint URL/v1
  --model M` sends streaming /v1/chat/completions, then 8 client-side rules (error rate, GPU use via
  optional NVML, batch fill, scheduler wait, tail latency, ...) write <output-dir>/findings.json.
- inferpilot 0.1.0: `inferpilot doctor --url URL` scrapes vLLM-named /metrics twice, --interval s apart
  (KV usage, requests waiting, preemptions) and prints one regime verdict. Sends no requests. (Its
  benchmark runner needs vLLM 0.29 on a GPU; `doctor` does not.)
- vllm-doctor 0.6.0: `vllm-doctor diagnose URL/metrics` scrapes /metrics once (or queries Prometheus)
  and runs 10 rules. Sends no requests; histogram percentiles are only read through Prometheus.
The two passive tools only see what traffic is doing at that moment, so the benchmark runs them while
its standard background load is running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from peers.venvs import PeerVenv

ALARM_LEVELS = {"critical", "warning", "high", "medium"}
"""A statement at one of these levels is a finding; kvpilot's "low" and the peers' "info" are notes."""

QUEUEING = r"queu|max[-_ ]num[-_ ]seqs|concurrency (limit|cap)|saturates near concurrency"
CAUSE_KEYWORDS = {
    # inference-profiler's "Throughput saturates near concurrency N" points at a concurrency cap too.
    "queueing": QUEUEING,
    # No peer has a static-batching rule; "under-filled" batches and queueing are the nearest it can say.
    "static-batching": QUEUEING + r"|static|continuous batching|under-filled",
    "prefix-caching": r"prefix",
    # "near capacity" is inferpilot's headline for "the KV cache is full, no preemptions yet";
    # preemptions are how vLLM-style engines show an exhausted KV pool.
    "kv-pool": r"kv[-_ ]?cache|kv[-_ ]?bound|kv[-_ ]?pool|memory|near capacity|preempt",
    # inference-profiler's "Requests wait ... in queue vs ... of prefill" counts: it blames prefill.
    "long-prompts": r"prefill|prompt length|long (prompt|request|input)|chunk",
    "cpu-starvation": r"cpu|starv|contention|noisy|steal",
    "network": r"network|proxy|rtt|\bhop\b",
    "client": r"client|load generator|benchmark (tool|harness)",
}
"""Matched (case-insensitive) against the headline of a peer's first finding only, not its advice text:
advice mentions other causes ("with no queue pressure", "memory bandwidth pressure"). Generous where a headline
could be read either way: a peer is never marked wrong for wording."""


@dataclass(frozen=True)
class Statement:
    """One finding or note of a tool, in the tool's own ranking; `headline` is what keywords are read in."""

    level: str
    headline: str
    detail: str = ""


@dataclass(frozen=True)
class Target:
    """The staged server a tool is pointed at, and a folder for the tool's files."""

    base_url: str
    model: str
    work_dir: Path


@dataclass
class ToolRun:
    """One command: what ran, how it ended, the tails of its output, and the verdict drawn from it."""

    command: list[str]
    exit_code: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    stdout_tail: str = ""
    stderr_tail: str = ""
    statements: list[Statement] = field(default_factory=list)
    cell: str = ""
    evidence: str = ""

    def to_json(self) -> dict:
        return {**asdict(self), "statements": [asdict(s) for s in self.statements]}


class ToolOutputError(RuntimeError):
    """The tool ran but left nothing to read a verdict from; the message says what was missing."""


@dataclass(frozen=True)
class DoctorTool:
    name: str
    requirement: str
    passive: bool  # reads /metrics only: needs the background load running
    command: Callable[[Path, Target], list[str]]  # (the venv's bin/, target) -> argv
    read: Callable[[str, Target], list[Statement]]  # (stdout, target) -> ranked statements


def _profiler_command(bin_dir: Path, target: Target) -> list[str]:
    # The README's quick start, sized for a 2-core CPU and a 512-token context.
    return [str(bin_dir / "inference-profiler"), "profile", "--endpoint", f"{target.base_url}/v1",
            "--model", target.model, "--requests", "16", "--concurrency", "8", "--prompt-tokens", "64-192",
            "--output-tokens", "16-32", "--warmup", "1", "--stream", "--seed", "0",
            "--output-dir", str(target.work_dir / "inference-profiler")]


def _profiler_read(stdout: str, target: Target) -> list[Statement]:
    path = target.work_dir / "inference-profiler" / "findings.json"
    if not path.is_file():
        raise ToolOutputError(f"no {path.name} written")
    return [Statement(f["severity"], f["title"], f.get("detail", "")) for f in json.loads(path.read_text())]


def _inferpilot_command(bin_dir: Path, target: Target) -> list[str]:
    # Two scrapes 30 s apart (its docs: "30-60s apart"); a 10 s scrape timeout for a busy 2-core server.
    return [str(bin_dir / "inferpilot"), "doctor", "--url", target.base_url, "--interval", "30",
            "--timeout", "10", "--plain", "--output", str(target.work_dir / "inferpilot-reading.json")]


INFERPILOT_LEVELS = {"healthy_or_underutilized": None, "insufficient_metrics": "info"}
"""inferpilot's verdict -> level; every other verdict (KV-bound, near capacity, compute/other-bound, need
a second snapshot) is a warning."""


def _inferpilot_read(stdout: str, target: Target) -> list[Statement]:
    path = target.work_dir / "inferpilot-reading.json"
    if not path.is_file():
        raise ToolOutputError(f"no {path.name} written")
    reading = json.loads(path.read_text())
    level = INFERPILOT_LEVELS.get(reading["verdict"], "warning")
    if level is None:
        return []
    # The printed headline is the line after the title's rule line ("✗ COMPUTE / OTHER-BOUND").
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    rule = next((i for i, line in enumerate(lines) if set(line) == {"─"}), None)
    if rule is None or rule + 1 >= len(lines):
        raise ToolOutputError("no headline printed under its title")
    headline = lines[rule + 1]
    return [Statement(level, headline, f"{reading['verdict']}: {reading['next_step']}")]


def _vllm_doctor_command(bin_dir: Path, target: Target) -> list[str]:
    return [str(bin_dir / "vllm-doctor"), "diagnose", f"{target.base_url}/metrics", "--output", "json"]


def _vllm_doctor_read(stdout: str, target: Target) -> list[Statement]:
    try:
        report = json.loads(stdout)
    except json.JSONDecodeError as error:
        raise ToolOutputError(f"stdout is not its JSON report ({error})") from None
    return [Statement(c["finding"]["severity"], c["finding"]["title"], c["finding"]["summary"])
            for c in report["checks"] if c.get("finding")]


TOOLS = (
    DoctorTool("inference-profiler", "inference-profiler==0.1.0", False, _profiler_command, _profiler_read),
    DoctorTool("inferpilot", "inferpilot==0.1.0", True, _inferpilot_command, _inferpilot_read),
    DoctorTool("vllm-doctor", "vllm-doctor==0.6.0", True, _vllm_doctor_command, _vllm_doctor_read),
)


def install_tool(tool: DoctorTool, cache_dir: Path) -> tuple[PeerVenv, str]:
    """The tool's venv under `cache_dir` (reused once its marker exists) and its installed version;
    InstallError (one line, naming the log) when pip fails."""
    venv = PeerVenv(cache_dir, tool.name)
    if not venv.is_installed():
        venv.create_fresh()
        venv.pip(["install", tool.requirement], f"pip install {tool.requirement}")
        venv.mark_installed(tool.requirement)
    package = tool.requirement.split("==")[0]
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    probe = subprocess.run([str(venv.python), "-c", code], check=False, capture_output=True, text=True)
    return venv, probe.stdout.strip() or "unknown"


def run_command(command: list[str], timeout_s: float, cwd: Path) -> tuple[ToolRun, str]:
    """Runs `command` in its own process group (killed whole at the time limit); the record and full stdout."""
    cwd.mkdir(parents=True, exist_ok=True)
    run = ToolRun(command)
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "160", "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        run.timed_out = True
        _kill_group(process)
        stdout, stderr = process.communicate()
    except BaseException:
        _kill_group(process)
        raise
    run.exit_code, run.seconds = process.returncode, round(time.monotonic() - started, 1)
    run.stdout_tail, run.stderr_tail = stdout[-3000:], stderr[-3000:]
    return run, stdout


def stop_group(process: subprocess.Popen, first: signal.Signals, wait_s: float = 15.0) -> None:
    """Stops the process's group: ``first``, then SIGKILL if it has not exited ``wait_s`` later."""
    for sig, wait in ((first, wait_s), (signal.SIGKILL, 5.0)):
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=wait)


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def judge(statements: list[Statement], named: Callable[[str], bool] | None) -> tuple[str, str]:
    """(cell, evidence) from a tool's ranked statements: `named(headline)` must hold for its first finding
    (a statement at an alarm level); `named` None means healthy, which wants no finding at all."""
    findings = [s for s in statements if s.level in ALARM_LEVELS]
    first = findings[0] if findings else None
    if first is None:
        notes = "; ".join(f"{s.level}: {s.headline}" for s in statements[:3])
        evidence = "no warning/critical finding" + (f" (notes: {notes})" if notes else "")
        return ("yes" if named is None else "no (only notes)" if notes else "no (nothing found)"), evidence
    shown = f"{first.level}: {first.headline} -- {first.detail[:160]}"
    return ("yes" if named is not None and named(first.headline) else f"no ({first.headline})"), shown


def keyword_matcher(cause: str) -> Callable[[str], bool]:
    return lambda headline: re.search(CAUSE_KEYWORDS[cause], headline, re.IGNORECASE) is not None


def checked_subset(parser: argparse.ArgumentParser, flag: str, value: str, allowed: list[str]) -> list[str]:
    """The comma-separated items of `value`, each one of `allowed` (else the parser's usage error)."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items or any(item not in allowed for item in items):
        parser.error(f"{flag}: choose from {','.join(allowed)}")
    return items
