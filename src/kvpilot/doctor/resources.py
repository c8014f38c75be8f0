"""Did the server get the machine? CPU time, run-queue wait, host load and steal of a local server.

When the probed server runs on this host (a loopback or local address), its processes are found by
the port they listen on (with their children: kvpilot's and vLLM's engine cores run in their own
process). Over the probe the meter reads, from /proc via psutil:

* the server's CPU time against wall time (cores it used),
* how long its threads were runnable but waited for a CPU (``/proc/<pid>/task/*/schedstat``, the
  kernel's run-queue delay: the direct measure of CPU starvation),
* the host's busy and steal shares, the load average, and the processes that used the most CPU
  besides the server and the doctor itself (the competitors),
* GPU utilisation and memory through NVML when ``nvidia-ml-py`` is installed (optional).

A remote server gets none of this; its ``process_cpu_seconds_total`` (when exported) still gives the
cores it used (see :func:`remote_usage`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import psutil

NUM_COMPETITORS = 3


@dataclass(frozen=True)
class Competitor:
    """Another process's CPU use over the probe, in cores (1.0 = one core busy the whole time)."""

    pid: int
    name: str
    cores: float


@dataclass(frozen=True)
class GpuUsage:
    """One GPU over the probe: mean utilisation (0-1) and peak memory."""

    index: int
    utilization: float
    memory_used_bytes: float
    memory_total_bytes: float


@dataclass(frozen=True)
class ResourceUsage:
    """What the server and the host did over ``wall_s`` seconds. None: not measured.

    Invariants: shares are in [0, 1]; ``server_cores`` is CPU seconds / wall seconds;
    ``run_queue_share`` is wait / (run + wait) of the server's threads (0 when never waiting)."""

    source: str
    wall_s: float
    num_cpus: int | None = None
    server_pids: tuple[int, ...] = ()
    server_cores: float | None = None
    run_queue_share: float | None = None
    host_busy_share: float | None = None
    steal_share: float | None = None
    load_avg_1m: float | None = None
    doctor_cores: float | None = None
    competitors: tuple[Competitor, ...] = ()
    gpus: tuple[GpuUsage, ...] = field(default=())

    @property
    def other_cores(self) -> float | None:
        """Cores the rest of the host used (busy host minus server minus this doctor)."""
        if self.host_busy_share is None or self.num_cpus is None or self.server_cores is None:
            return None
        return max(0.0, self.host_busy_share * self.num_cpus - self.server_cores - (self.doctor_cores or 0.0))

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "wall_s": round(self.wall_s, 2), "num_cpus": self.num_cpus,
                "server_pids": list(self.server_pids), "server_cores": self.server_cores,
                "run_queue_share": self.run_queue_share, "host_busy_share": self.host_busy_share,
                "steal_share": self.steal_share, "load_avg_1m": self.load_avg_1m,
                "doctor_cores": self.doctor_cores, "other_cores": self.other_cores,
                "competitors": [c.__dict__ for c in self.competitors], "gpus": [g.__dict__ for g in self.gpus]}


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, or one of its interface addresses)."""
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    local = {a.address for nics in psutil.net_if_addrs().values() for a in nics}
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in local or a in ("0.0.0.0", "::")
               for a in addrs)


def listening_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` here (None: not found, or not visible to this user)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    return next((c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                 and c.pid), None)


def server_pids_for(url: str) -> tuple[int, ...]:
    """The local server's process and its descendants (never this doctor or its own children)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    if not is_local_host(host):
        return ()
    pid = listening_pid(port)
    return pids_with_children(pid) if pid is not None else ()


def pids_with_children(pid: int) -> tuple[int, ...]:
    """``pid`` and its descendants, minus this process and its descendants (the doctor and its
    workers may be the server's children when both run from one test process)."""
    mine = {os.getpid(), *(c.pid for c in _children(os.getpid()))}
    return tuple(p for p in (pid, *(c.pid for c in _children(pid))) if p not in mine)


def server_tree(pid: int) -> tuple[int, ...]:
    """``pid`` and all its descendants (a server this doctor started is its own child)."""
    return (pid, *(c.pid for c in _children(pid)))


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _cpu_s(pid: int) -> float | None:
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


def _schedstat(pid: int) -> dict[int, tuple[int, int]]:
    """Per thread: (ns on a CPU, ns runnable but waiting for one)."""
    out: dict[int, tuple[int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                run_ns, wait_ns, *_ = fh.read().split()
            out[int(tid)] = (int(run_ns), int(wait_ns))
        except (OSError, ValueError):
            continue
    return out


def _host_total(t: Any) -> float:
    """All CPU time of the host (guest time is already inside user/nice on Linux)."""
    return sum(v for k, v in t._asdict().items() if k not in ("guest", "guest_nice"))


def _all_cpu() -> dict[int, tuple[str, float]]:
    out = {}
    for p in psutil.process_iter(["name", "cpu_times"]):
        t = p.info.get("cpu_times")
        if t is not None:
            out[p.pid] = (str(p.info.get("name") or "?"), t.user + t.system)
    return out


@dataclass
class _Point:
    t: float
    host: Any
    server_cpu: dict[int, float]
    sched: dict[int, tuple[int, int]]
    procs: dict[int, tuple[str, float]]


class ResourceMeter:
    """Reads /proc at ``start`` and ``stop`` (and NVML in between when present); not thread-safe."""

    def __init__(self, server_pids: tuple[int, ...], source: str) -> None:
        self.server_pids, self.source = server_pids, source
        self._start: _Point | None = None
        self._gpu = _Nvml.open()

    def _point(self) -> _Point:
        cpu = {p: c for p in self.server_pids if (c := _cpu_s(p)) is not None}
        sched = {tid: v for p in self.server_pids for tid, v in _schedstat(p).items()}
        return _Point(time.monotonic(), psutil.cpu_times(), cpu, sched, _all_cpu())

    def start(self) -> None:
        self._start = self._point()
        if self._gpu is not None:
            self._gpu.sample()

    def sample(self) -> None:
        """Called between phases: GPU utilisation is a gauge, so it is averaged over samples."""
        if self._gpu is not None:
            self._gpu.sample()

    def stop(self) -> ResourceUsage | None:
        if self._start is None:
            return None
        a, b = self._start, self._point()
        wall = max(1e-6, b.t - a.t)
        run = sum(b.sched[t][0] - a.sched[t][0] for t in b.sched.keys() & a.sched.keys())
        wait = sum(b.sched[t][1] - a.sched[t][1] for t in b.sched.keys() & a.sched.keys())
        server_cpu = sum(b.server_cpu[p] - a.server_cpu[p] for p in b.server_cpu.keys() & a.server_cpu.keys())
        total = _host_total(b.host) - _host_total(a.host)
        idle = (b.host.idle + getattr(b.host, "iowait", 0.0)) - (a.host.idle + getattr(a.host, "iowait", 0.0))
        steal = getattr(b.host, "steal", 0.0) - getattr(a.host, "steal", 0.0)
        mine = {os.getpid(), *(c.pid for c in _children(os.getpid()))} - set(self.server_pids)
        others = sorted(((pid, name, (cpu - a.procs[pid][1]) / wall) for pid, (name, cpu) in b.procs.items()
                         if pid in a.procs and pid not in mine and pid not in self.server_pids), key=lambda x: -x[2])
        doctor = sum((b.procs[p][1] - a.procs[p][1]) for p in mine if p in a.procs and p in b.procs) / wall
        if self._gpu is not None:
            self._gpu.sample()
        return ResourceUsage(
            source=self.source, wall_s=wall, num_cpus=psutil.cpu_count(), server_pids=self.server_pids,
            server_cores=server_cpu / wall if self.server_pids else None,
            run_queue_share=wait / (run + wait) if run + wait > 0 else None,
            host_busy_share=(total - idle) / total if total > 0 else None,
            steal_share=steal / total if total > 0 else None, load_avg_1m=os.getloadavg()[0],
            doctor_cores=doctor,
            competitors=tuple(Competitor(pid, name, round(c, 3)) for pid, name, c in others[:NUM_COMPETITORS]
                              if c >= 0.05),
            gpus=self._gpu.usage() if self._gpu is not None else ())


def meter_for(url: str, pids: tuple[int, ...] | None = None) -> ResourceMeter | None:
    """A meter when the server at ``url`` runs here (``pids``: known already, e.g. a --serve child)."""
    pids = pids if pids else server_pids_for(url)
    if not pids:
        return None
    return ResourceMeter(pids, f"/proc of local server pid {pids[0]}" + (f" (+{len(pids) - 1} children)"
                                                                          if len(pids) > 1 else ""))


def remote_usage(cpu_seconds: float | None, wall_s: float) -> ResourceUsage | None:
    """From the server's own ``process_cpu_seconds_total`` delta: the cores it used, nothing else."""
    if cpu_seconds is None or wall_s <= 0:
        return None
    return ResourceUsage(source="process_cpu_seconds_total of /metrics", wall_s=wall_s,
                         server_cores=cpu_seconds / wall_s)


class _Nvml:
    """GPU gauges through NVML (``nvidia-ml-py``, optional): absent package or driver -> no GPU data."""

    def __init__(self, nvml: Any, handles: list[Any]) -> None:
        self.nvml, self.handles = nvml, handles
        self.util: list[list[float]] = [[] for _ in handles]
        self.mem: list[tuple[float, float]] = [(0.0, 0.0) for _ in handles]

    @staticmethod
    def open() -> _Nvml | None:
        try:
            import pynvml  # noqa: PLC0415 (optional: nvidia-ml-py)

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 (no package, no driver, no GPU: all mean "no GPU data")
            return None
        return _Nvml(pynvml, handles) if handles else None

    def sample(self) -> None:
        for i, h in enumerate(self.handles):
            try:
                self.util[i].append(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
                mem = self.nvml.nvmlDeviceGetMemoryInfo(h)
                self.mem[i] = (max(self.mem[i][0], float(mem.used)), float(mem.total))
            except Exception:  # noqa: BLE001 (a GPU that fell off the bus reports nothing)
                continue

    def usage(self) -> tuple[GpuUsage, ...]:
        return tuple(GpuUsage(i, sum(u) / len(u), self.mem[i][0], self.mem[i][1])
                     for i, u in enumerate(self.util) if u)
