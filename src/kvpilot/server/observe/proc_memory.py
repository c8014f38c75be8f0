"""Where the server's memory lives, read from Linux's /proc at scrape time: the process's resident and
swapped-out bytes, its major page faults, and the host's swap.

Parsing is separate from reading (``parse_*`` take the file's text), so it is tested on fixed text.
Readers return None where the file or field does not exist (not Linux, a sandbox without /proc):
``/metrics`` then simply has no such series, it never fails.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_KB_FIELD = re.compile(r"^(\w+):\s+(\d+)\s*kB\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ProcessMemory:
    """One process's memory, in bytes. Invariant: all values >= 0; a field is None where the kernel
    does not report it (``VmSwap`` is missing on kernels without swap support)."""

    resident_bytes: int | None
    swap_bytes: int | None
    major_faults: int | None


@dataclass(frozen=True)
class HostSwap:
    """The host's swap space, in bytes. Invariant: ``0 <= free_bytes <= total_bytes`` (0 and 0: no swap)."""

    total_bytes: int
    free_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes


def kb_fields(text: str) -> dict[str, int]:
    """``Name:   123 kB`` lines (``/proc/<pid>/status``, ``/proc/meminfo``) -> {Name: bytes}."""
    return {name: int(kb) * 1024 for name, kb in _KB_FIELD.findall(text)}


def parse_major_faults(stat_text: str) -> int | None:
    """``majflt`` (field 12) of ``/proc/<pid>/stat``: summed over the process's threads by the kernel.
    The command name (field 2) may hold spaces and parentheses, so fields are counted after the last
    ``)``. None for text that is not a stat line."""
    _, sep, rest = stat_text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 10 or not fields[9].isdigit():
        return None
    return int(fields[9])  # fields[0] is field 3 (state)


def parse_process_memory(status_text: str, stat_text: str | None = None) -> ProcessMemory | None:
    """``/proc/<pid>/status`` (VmRSS, VmSwap) and optionally ``/proc/<pid>/stat`` (majflt); None when
    the status text has neither field (e.g. a kernel thread, or not a status file at all)."""
    fields = kb_fields(status_text)
    rss, swap = fields.get("VmRSS"), fields.get("VmSwap")
    if rss is None and swap is None:
        return None
    return ProcessMemory(rss, swap, parse_major_faults(stat_text) if stat_text else None)


def parse_host_swap(meminfo_text: str) -> HostSwap | None:
    """``SwapTotal`` and ``SwapFree`` of ``/proc/meminfo``; None when either is missing."""
    fields = kb_fields(meminfo_text)
    total, free = fields.get("SwapTotal"), fields.get("SwapFree")
    if total is None or free is None:
        return None
    return HostSwap(total, min(free, total))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def read_process_memory(pid: str = "self", proc: Path = PROC) -> ProcessMemory | None:
    """This process's (or ``pid``'s) memory; None where /proc has no such file (not Linux)."""
    status = _read(proc / pid / "status")
    return parse_process_memory(status, _read(proc / pid / "stat")) if status is not None else None


def read_host_swap(proc: Path = PROC) -> HostSwap | None:
    """The host's swap (as seen from this process's namespace); None without /proc/meminfo."""
    meminfo = _read(proc / "meminfo")
    return parse_host_swap(meminfo) if meminfo is not None else None


def _sum(values: list[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def sum_process_memory(readings: list[ProcessMemory | None]) -> ProcessMemory | None:
    """Field-wise sum over processes (the server and its engine core process: the weights and KV blocks live
    in the core); a field is None only where no process reports it; None when no process could be read."""
    found = [r for r in readings if r is not None]
    if not found:
        return None
    return ProcessMemory(_sum([r.resident_bytes for r in found]), _sum([r.swap_bytes for r in found]),
                         _sum([r.major_faults for r in found]))
