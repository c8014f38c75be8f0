"""Staging memory spillover for real (tests only, Linux, root): a swap file and a memory cgroup that caps
a `kvpilot serve` process below its resident set (the process itself: tests/served_process.py).

The kernel then does what it does on an over-committed host: it writes the server's pages (weights,
KV blocks, the Python heap) to swap and reads them back when a step touches them. Nothing in kvpilot
is changed or faked. Every helper is a context manager that undoes what it did, in reverse order of
setup: the server is killed before its cgroup is removed, and the cgroup is removed before swapoff
(pages still charged to a capped cgroup cannot be swapped back in).

What the machine does not allow raises :class:`StagingUnavailable`; the test skips with its message.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path


from kvpilot.server.observe.proc_memory import ProcessMemory, read_process_memory, sum_process_memory

CGROUP_V1_ROOT = Path("/sys/fs/cgroup/memory")
CGROUP_V2_ROOT = Path("/sys/fs/cgroup")


def read_server_memory(pid: int) -> ProcessMemory | None:
    """A server process's memory together with its children's: `kvpilot serve` keeps the weights and KV
    blocks in its engine core, a child process (the same sum its /metrics reports)."""
    children = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.name.isdigit() and int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == pid:
                children.append(read_process_memory(entry.name))
    return sum_process_memory([read_process_memory(str(pid)), *children])


class StagingUnavailable(RuntimeError):
    """This machine cannot stage the fault (not Linux, not root, swapon or the memory cgroup refused);
    the message says which and what would allow it."""


class CapRefused(StagingUnavailable):
    """The kernel refused a cap below the cgroup's usage: it could not reclaim down to it now."""


def require_linux_root() -> None:
    """Raises StagingUnavailable unless this is Linux, run as root, with the swap tools installed."""
    if not sys.platform.startswith("linux"):
        raise StagingUnavailable(f"needs Linux (swap files and memory cgroups), this is {sys.platform}")
    if os.geteuid() != 0:
        raise StagingUnavailable("needs root: swapon and memory cgroups are privileged (run the test as root)")
    missing = [tool for tool in ("mkswap", "swapon", "swapoff") if shutil.which(tool) is None]
    if missing:
        raise StagingUnavailable(f"needs {', '.join(missing)} (util-linux) on PATH")


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=60, check=False)


def _write_zeros(path: Path, size_bytes: int) -> None:
    chunk = bytes(2**20)
    with path.open("wb") as fh:
        for _ in range(size_bytes // len(chunk)):
            fh.write(chunk)


@contextlib.contextmanager
def swap_file(directory: Path, size_bytes: int) -> Iterator[Path]:
    """A swap file of ``size_bytes`` in ``directory``, active inside the block; swapoff and delete on
    exit, always. Preallocated (``posix_fallocate``); a filesystem that refuses a preallocated swap
    file (holes) gets one written with zeros instead. Raises StagingUnavailable when swapon refuses
    both (tmpfs, a container without CAP_SYS_ADMIN)."""
    path = directory / "kvpilot-spill.swap"
    try:
        for fill in ("fallocate", "zeros"):
            with path.open("wb") as fh:
                if fill == "fallocate":
                    os.posix_fallocate(fh.fileno(), 0, size_bytes)
            if fill == "zeros":
                _write_zeros(path, size_bytes)
            path.chmod(0o600)
            made = _run("mkswap", str(path))
            on = _run("swapon", str(path)) if made.returncode == 0 else made
            if on.returncode == 0:
                break
        else:
            raise StagingUnavailable(f"swapon of a file in {directory} was refused: "
                                     f"{(on.stderr or on.stdout).strip()}")
        yield path
    finally:
        if path.exists():
            _swapoff(path)
            path.unlink()


def _swapoff(path: Path) -> None:
    """swapoff reads every page back into memory; retried briefly (a cgroup being torn down may still
    hold charges for a moment)."""
    if str(path) not in Path("/proc/swaps").read_text():
        return
    for _ in range(10):
        if _run("swapoff", str(path)).returncode == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"swapoff {path} failed: the swap file is still active, run `swapoff {path}` by hand")


@dataclass(frozen=True)
class MemoryCgroup:
    """A memory cgroup of our own (v1: a child of this process's memory cgroup; v2: a child of the
    hierarchy's root, the only place a v2 controller can be enabled for a child next to processes).

    A cap below the working set makes the kernel reclaim into swap. Under v1's hard limit, a fault it
    cannot satisfy at once invokes the OOM killer, so the v1 cgroup is created with the OOM killer
    disabled: the faulting task waits instead, until the cap is raised (see :class:`EdgeSqueezer`).
    v2 caps with ``memory.high``, which throttles and reclaims but never kills."""

    path: Path
    version: int

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def squeeze(self, max_bytes: int) -> None:
        """Cap resident memory (swap stays allowed): the kernel reclaims the excess into swap at once.
        Raises StagingUnavailable when the kernel refuses (it could not reclaim enough: no swap room)."""
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.high"
        try:
            (self.path / name).write_text(str(max_bytes))
        except OSError as exc:
            raise CapRefused(f"the memory cgroup refused a {max_bytes >> 20} MiB cap ({exc}): it could not "
                             "reclaim down to it (no swap room, or every page in use)") from exc

    def release(self) -> None:
        """No cap (wakes every task waiting for memory)."""
        with contextlib.suppress(OSError):
            (self.path / ("memory.limit_in_bytes" if self.version == 1 else "memory.high")).write_text(
                "-1" if self.version == 1 else "max")

    def under_oom(self) -> bool:
        """v1: a task waits for memory the cap cannot give (the OOM killer is disabled). v2: never."""
        if self.version != 1:
            return False
        return "under_oom 1" in (self.path / "memory.oom_control").read_text()

    def usage_bytes(self) -> int:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return int((self.path / name).read_text())

    def exec_prefix(self) -> list[str]:
        """Prepend to a command: the shell puts itself into this cgroup, then becomes the command, so
        every page the command ever allocates is charged here."""
        return ["sh", "-c", f'echo $$ > "{self.procs}" && exec "$@"', "sh"]


class EdgeSqueezer:
    """Holds a cgroup's cap at the edge of its working set, like a proactive-reclaim agent (Meta's
    senpai, which keeps a target memory pressure) tuned too tight: :meth:`lower` squeezes; a daemon
    thread raises the cap by ``step_bytes`` whenever a task waits for memory the cap cannot give (v1
    ``under_oom``, checked every ``poll_s``: the raise wakes it), and, once :meth:`limit_faults` named
    a process, whenever that process's major faults over the last ``rate_window_s`` exceed the given
    rate. The workload thrashes (its pages go to swap and come back) at a bounded pressure instead of
    being killed or stalled. Invariant: the cap only rises between two :meth:`lower` calls."""

    def __init__(self, cgroup: MemoryCgroup, step_bytes: int, poll_s: float = 0.05, rate_window_s: float = 0.5) -> None:
        self.cgroup, self.step_bytes, self.poll_s, self.rate_window_s = cgroup, step_bytes, poll_s, rate_window_s
        self.cap_bytes: int | None = None
        self.num_raises = 0
        self._pid: int | None = None
        self._max_faults_per_s = float("inf")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="edge-squeezer", daemon=True)

    def lower(self, cap_bytes: int, attempts: int = 3) -> None:
        """Squeeze to ``cap_bytes``. The kernel refuses a cap when one reclaim pass frees nothing
        (pages still under writeback to swap, say): retried ``attempts`` times, 0.2 s apart, then
        CapRefused propagates."""
        for attempt in range(attempts):
            try:
                with self._lock:
                    self.cgroup.squeeze(cap_bytes)
                    self.cap_bytes = cap_bytes
                return
            except CapRefused:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.2)

    def limit_faults(self, pid: int, max_per_s: float) -> None:
        """From now on also raise the cap while ``pid`` takes more than ``max_per_s`` major faults/s."""
        with self._lock:
            self._pid, self._max_faults_per_s = pid, max_per_s

    def _faults(self) -> int | None:
        mem = read_server_memory(self._pid) if self._pid is not None else None
        return mem.major_faults if mem is not None else None

    def _raise(self) -> None:
        if self.cap_bytes is not None:
            self.cap_bytes += self.step_bytes
            self.cgroup.squeeze(self.cap_bytes)
            self.num_raises += 1

    def _watch(self) -> None:
        mark, faults_then = time.monotonic(), None
        while not self._stop.wait(self.poll_s):
            with self._lock:
                if self.cgroup.under_oom():
                    self._raise()
                now = time.monotonic()
                if now - mark >= self.rate_window_s:
                    faults = self._faults()
                    if faults is not None and faults_then is not None and \
                            (faults - faults_then) / (now - mark) > self._max_faults_per_s:
                        self._raise()
                    mark, faults_then = now, faults

    def __enter__(self) -> EdgeSqueezer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.cgroup.release()


def _own_cgroup_v1() -> Path | None:
    """This process's cgroup-v1 memory cgroup directory, when the v1 memory controller is mounted."""
    if not (CGROUP_V1_ROOT / "cgroup.procs").exists():
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_V1_ROOT / rel.lstrip("/")
    return None


def _v2_root() -> Path | None:
    controllers = CGROUP_V2_ROOT / "cgroup.subtree_control"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return CGROUP_V2_ROOT
    return None


@contextlib.contextmanager
def memory_cgroup(name: str) -> Iterator[MemoryCgroup]:
    """A new, uncapped memory cgroup (v1: OOM killer disabled); on exit whatever is left in it is
    moved to its parent and the directory removed. Raises StagingUnavailable without a writable
    memory controller."""
    parent, version = _own_cgroup_v1(), 1
    if parent is None:
        parent, version = _v2_root(), 2
    if parent is None:
        raise StagingUnavailable("no memory cgroup controller: neither cgroup v1 /sys/fs/cgroup/memory nor "
                                 "cgroup v2 with memory in /sys/fs/cgroup/cgroup.subtree_control")
    path = parent / name
    try:
        path.mkdir()
    except OSError as exc:
        raise StagingUnavailable(f"cannot create memory cgroup {path}: {exc}") from exc
    try:
        if version == 1:  # a fault the cap cannot satisfy waits (for EdgeSqueezer) instead of killing
            try:
                (path / "memory.oom_control").write_text("1")
            except OSError as exc:
                raise StagingUnavailable(f"cannot disable the OOM killer of {path} ({exc}): a cap below the "
                                         "working set would kill the server instead of making it swap") from exc
        yield MemoryCgroup(path, version)
    finally:
        _remove_cgroup(path)


def _remove_cgroup(path: Path) -> None:
    for _ in range(20):
        with contextlib.suppress(OSError):
            for pid in (path / "cgroup.procs").read_text().split():
                (path.parent / "cgroup.procs").write_text(pid)
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.25)
    raise RuntimeError(f"cannot remove memory cgroup {path}: rmdir it by hand after its processes exit")


@dataclass(frozen=True)
class Squeezed:
    """A cap found by :func:`squeeze_until_it_reads_back`: the cap in force, and what one generate()
    call measured under it (steady state): major faults per token and seconds vs uncapped."""

    cap_bytes: int
    faults_per_token: float
    slowdown: float
    tried: tuple[str, ...]


def squeeze_until_it_reads_back(squeezer: EdgeSqueezer, pid: int, generate: Callable[[float], int], low_bytes: int,
                                high_bytes: int, faults_per_token: float, max_slowdown: float,
                                resolution_bytes: int = 2 * 2**20) -> Squeezed:
    """Find a cap between ``low_bytes`` (too tight) and ``high_bytes`` (the working set fits) at which
    process ``pid`` reads its pages back from swap on every step, yet still answers: a
    ``generate(timeout_s)`` call (returns the tokens it generated, raises TimeoutError after
    ``timeout_s``) takes at least ``faults_per_token`` major page faults per token and at most
    ``max_slowdown`` times as long as uncapped, in steady state (the second call at that cap: the
    first reads back what the squeeze itself pushed out, even when the working set fits).

    Bisection: a cap the kernel refuses (it could not reclaim down to it) or one slower than
    ``max_slowdown`` is too tight; one with fewer read-backs too loose. (A process that waited for
    memory meanwhile got a raised cap from the squeezer: what counts is what it measured.)
    The window is narrow (on the test machine ~15 MiB of ~1 GiB: below it the kernel refuses the cap,
    a v1 hard limit would OOM-kill, or decode slows 50x), so a fixed step could jump over it.
    Raises StagingUnavailable when the kernel swaps nothing out (vm.swappiness 0, cgroup swap
    accounting off); StagingUnavailable when no cap in the range worked."""
    uncapped = min(_timed(generate) for _ in range(2))
    first_timeout_s = max(10.0, 3 * max_slowdown * uncapped)
    lo, hi, tried = low_bytes, high_bytes, []
    while hi - lo > resolution_bytes:
        cap = (lo + hi) // 2 // 4096 * 4096
        try:
            squeezer.lower(cap)
        except CapRefused:
            lo = cap
            tried.append(f"{cap >> 20} MiB refused")
            continue
        try:
            per_token, seconds, raised = _steady_read_backs(squeezer, pid, generate, first_timeout_s,
                                                            max_slowdown * uncapped)
        except TimeoutError:
            lo = cap
            tried.append(f"{cap >> 20} MiB: over {max_slowdown:.0f}x")
            continue
        slowdown = seconds / uncapped
        tried.append(f"{cap >> 20} MiB: {per_token:.0f}/token, {slowdown:.1f}x" + (" (waited)" if raised else ""))
        if slowdown > max_slowdown:
            lo = cap
        elif per_token < faults_per_token:
            hi = cap
        else:
            return Squeezed(squeezer.cap_bytes or cap, per_token, slowdown, tuple(tried))
    # The window between "only cold pages swapped" and "thrashing beyond max_slowdown" can be narrower than
    # the resolution on a given VM and run (seen: 549 MiB reads 0 pages/token back, 542 MiB is over 8x): the
    # staging could not produce the condition, which says nothing about the doctor (unit-tested on fixtures).
    raise StagingUnavailable("no cap made the server read pages back from swap at a bearable speed: "
                             + ", ".join(tried))


def _timed(generate: Callable[[float], int]) -> float:
    started = time.perf_counter()
    generate(60.0)
    return time.perf_counter() - started


def _steady_read_backs(squeezer: EdgeSqueezer, pid: int, generate: Callable[[float], int], first_timeout_s: float,
                       timeout_s: float) -> tuple[float, float, bool]:
    """(major faults per generated token, seconds) of the second of two ``generate()`` calls, and
    whether the squeezer had to raise the cap meanwhile (the process waited for memory). TimeoutError
    when a call takes longer than its timeout."""
    raises = squeezer.num_raises
    generate(first_timeout_s)
    before = read_server_memory(pid)
    if before is None or before.major_faults is None or not before.swap_bytes:
        raise StagingUnavailable(f"the kernel swapped nothing of process {pid} out under a "
                                 f"{(squeezer.cap_bytes or 0) >> 20} MiB cap (vm.swappiness 0, or /proc without "
                                 "VmSwap / majflt?)")
    started = time.perf_counter()
    tokens = generate(timeout_s)
    seconds = time.perf_counter() - started
    after = read_server_memory(pid)
    faults = (after.major_faults or 0) - before.major_faults if after is not None else 0
    return faults / max(1, tokens), seconds, squeezer.num_raises > raises
