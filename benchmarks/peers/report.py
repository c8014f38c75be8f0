"""The printed report: machine header, one line per engine x workload x pass (dropped passes marked), per
comparison each engine's median over its valid passes and the kvpilot/peer ratios with their min-max, and
each server's peak RSS side by side across comparisons (e.g. kvpilot on the Q4_K_M copy against the Q4_0 one).

Ratios compare each peer pass with the mean of the kvpilot passes just before and after it (the run
alternates kvpilot, peer, kvpilot, ...), so slow drift of a shared machine cancels to first order; the
figure is the median of those per-pass ratios (peers/passes.py decides which passes count).
"""

from __future__ import annotations

import datetime
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from peers.comparisons import Comparison
from peers.passes import MIN_VALID_PASSES, Metric, RunRows, Spread, engine_spread, ratio_spread, row_problems
from peers.workloads import Row, Workload

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


def rows_table(rows: list[Row], workloads: dict[str, Workload] | None = None) -> list[str]:
    """Header and one line per row; with `workloads`, a row that cannot be used says why (DROPPED)."""
    lines = [f"{'workload':<8} {'engine':<16} {'pass':>4} {'out tok/s':>10} {'prompt tok/s':>12} "
             f"{'TTFT p50 ms':>11} {'ITL p50 ms':>10} {'ok/err':>7} {'out/req':>7} {'peak RSS MiB':>12}"]
    for row in sorted(rows, key=lambda r: (r.workload, r.pass_index)):
        flag = "  CLIENT OVERLOADED" if row.client_overloaded else ""
        workload = (workloads or {}).get(row.workload)
        problems = row_problems(row, workload) if workload is not None else []
        if problems:
            flag += f"  DROPPED: {'; '.join(problems)}"
        lines.append(f"{row.workload:<8} {row.engine:<16} {row.pass_index:>4} {_fmt(row.output_tok_s):>10} "
                     f"{_fmt(row.prompt_tok_s):>12} {_fmt(row.ttft_p50_ms):>11} {_fmt(row.itl_p50_ms, 2):>10} "
                     f"{row.num_ok:>3}/{row.num_errors:<3} {row.mean_output_tokens:>7.1f} "
                     f"{_fmt(row.peak_rss_mib):>12}{flag}")
    return lines


def headline(row: Row, is_prefill: bool) -> float:
    """The throughput a workload is judged by: prompt tok/s for prefill, output tok/s otherwise."""
    return row.prompt_tok_s if is_prefill else row.output_tok_s


def metrics(workload: Workload) -> list[tuple[str, Metric]]:
    """(name, metric) judged per workload: its throughput, then TTFT and (not for prefill) ITL medians."""
    if workload.is_prefill:
        return [("prompt tok/s", lambda r: r.prompt_tok_s), ("TTFT p50", lambda r: r.ttft_p50_ms)]
    return [("out tok/s", lambda r: r.output_tok_s), ("TTFT p50", lambda r: r.ttft_p50_ms),
            ("ITL p50", lambda r: r.itl_p50_ms)]


def comparison_lines(comparison: Comparison, sequence: list[str], rows: list[Row], workloads: list[Workload],
                     required: int = MIN_VALID_PASSES) -> list[str]:
    """Per workload: each contender's median throughput over its valid passes (min-max), then ours/peer
    ratios of throughput (>1: kvpilot faster), TTFT and ITL (<1: kvpilot quicker), then the dropped passes."""
    contenders = comparison.contenders()
    lines = [f"# {comparison.name}: " + " vs ".join(c.label for c in contenders)
             + f" (medians of valid passes; at least {required} needed)"]
    for workload in workloads:
        run = RunRows.of(sequence, rows, workload.name)
        (name, throughput), *latencies = metrics(workload)
        spreads: list[Spread] = []
        for contender in contenders:
            spreads.append(engine_spread(run, contender.label, workload, throughput, required))
            lines.append(f"{workload.name:<8} {contender.label:<32} {name} {spreads[-1].describe()}")
        for peer in comparison.peers if comparison.ours is not None else ():
            parts = []
            for metric_name, metric in [(name, throughput), *latencies]:
                spreads.append(ratio_spread(run, comparison.ours.label, peer.label, workload, metric, required))
                parts.append(f"{metric_name} {spreads[-1].describe(2, 'x')}")
            lines.append(f"{workload.name:<8} {comparison.ours.label + '/' + peer.label:<32} " + "; ".join(parts))
        dropped = dict.fromkeys(reason for spread in spreads for reason in spread.dropped)
        lines += [f"{workload.name:<8}   dropped {reason}" for reason in dropped]
    return lines



def peak_rss(row: Row) -> float | None:
    return row.peak_rss_mib


def memory_lines(sequence: list[str], rows: list[Row], workloads: list[Workload],
                 required: int = MIN_VALID_PASSES) -> list[str]:
    """Per workload, each engine label of the run's `sequence`: its peak RSS (MiB, median of its valid passes
    with min-max), all comparisons' servers together: memory does not drift with the machine's load, so labels
    from different comparisons (kvpilot-q4_k_m against kvpilot-q4_0) compare directly."""
    lines = ["# peak RSS, MiB (sum over each server's processes of their peaks since start, read when the "
             f"workload ended; medians of valid passes, at least {required} needed)"]
    for workload in workloads:
        run = RunRows.of(sequence, rows, workload.name)
        for label in dict.fromkeys(sequence):
            spread = engine_spread(run, label, workload, peak_rss, required)
            lines.append(f"{workload.name:<8} {label:<32} {spread.describe(suffix=' MiB')}")
    return lines
