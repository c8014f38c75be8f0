"""The printed report: machine header, one line per engine x workload x pass, and kvpilot/peer ratios.

Ratios compare each peer pass with the mean of the kvpilot passes just before and after it (the run
alternates kvpilot, peer, kvpilot, ...), so slow drift of a shared machine cancels to first order.
"""

from __future__ import annotations

import datetime
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from peers.workloads import Row

INTERESTING_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
                     "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Machine:
    date_utc: str
    cpu_model: str
    cpu_family: str
    cpu_model_number: str
    num_cpus: int
    flags: list[str]
    kvpilot_commit: str

    def header_lines(self, script: str = "peers_cpu.py") -> list[str]:
        shown = [f for f in INTERESTING_FLAGS if f in self.flags]
        return [f"# {script}  {self.date_utc}  kvpilot {self.kvpilot_commit}",
                f"# CPU: {self.cpu_model} (family {self.cpu_family}, model {self.cpu_model_number}), "
                f"{self.num_cpus} CPUs; flags: {' '.join(shown) or 'none of ' + ','.join(INTERESTING_FLAGS)}"]


def describe_machine(repo_root: Path) -> Machine:
    fields = _lscpu()
    commit = subprocess.run(["git", "-C", str(repo_root), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return Machine(
        date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cpu_model=fields.get("Model name", platform.processor() or "unknown"),
        cpu_family=fields.get("CPU family", "?"), cpu_model_number=fields.get("Model", "?"),
        num_cpus=int(fields.get("CPU(s)", "0") or 0), flags=fields.get("Flags", "").split(),
        kvpilot_commit=commit)


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def rows_table(rows: list[Row]) -> list[str]:
    lines = [f"{'workload':<8} {'engine':<12} {'pass':>4} {'out tok/s':>10} {'prompt tok/s':>12} "
             f"{'TTFT p50 ms':>11} {'ITL p50 ms':>10} {'ok/err':>7} {'out/req':>7}"]
    for row in sorted(rows, key=lambda r: (r.workload, r.pass_index)):
        flag = "  CLIENT OVERLOADED" if row.client_overloaded else ""
        lines.append(f"{row.workload:<8} {row.engine:<12} {row.pass_index:>4} {_fmt(row.output_tok_s):>10} "
                     f"{_fmt(row.prompt_tok_s):>12} {_fmt(row.ttft_p50_ms):>11} {_fmt(row.itl_p50_ms, 2):>10} "
                     f"{row.num_ok:>3}/{row.num_errors:<3} {row.mean_output_tokens:>7.1f}{flag}")
    return lines


def headline(row: Row, is_prefill: bool) -> float:
    """The throughput a workload is judged by: prompt tok/s for prefill, output tok/s otherwise."""
    return row.prompt_tok_s if is_prefill else row.output_tok_s


def ratio_lines(rows: list[Row], prefill_workloads: set[str]) -> list[str]:
    """kvpilot/peer per peer pass and workload: throughput (>1: kvpilot faster), TTFT and ITL (<1: kvpilot
    quicker), against the kvpilot passes adjacent to that peer pass."""
    lines = []
    for peer in sorted((r for r in rows if r.engine != "kvpilot"), key=lambda r: (r.pass_index, r.workload)):
        neighbours = [r for r in rows if r.engine == "kvpilot" and r.workload == peer.workload
                      and abs(r.pass_index - peer.pass_index) == 1]
        if not neighbours:
            continue
        is_prefill = peer.workload in prefill_workloads
        ours = mean(headline(r, is_prefill) for r in neighbours)
        theirs = headline(peer, is_prefill)
        metric = "prompt tok/s" if is_prefill else "out tok/s"
        parts = [f"{metric} {_ratio(ours, theirs)}"]
        parts.append(f"TTFT p50 {_ratio(_mean_or_none(r.ttft_p50_ms for r in neighbours), peer.ttft_p50_ms)}")
        if not is_prefill:
            parts.append(f"ITL p50 {_ratio(_mean_or_none(r.itl_p50_ms for r in neighbours), peer.itl_p50_ms)}")
        lines.append(f"kvpilot/{peer.engine:<11} {peer.workload:<8} " + ", ".join(parts))
    return lines


def _mean_or_none(values) -> float | None:
    present = [v for v in values if v is not None]
    return mean(present) if present else None


def _ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or not theirs:
        return "-"
    return f"{ours / theirs:.2f}x"
