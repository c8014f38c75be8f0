"""Builds kvpilot's C++ CPU kernels with torch's cpp_extension (JIT, cached on disk by torch under
~/.cache/torch_extensions), the one way for all of them: KVPILOT_CPU_KERNELS=0 switches them off; the module
name carries the sources' hash (an edited kernel is rebuilt, never a stale cached one loaded) and torch's build,
not its path (every virtual environment or clone with the same torch finds the module built once, and loads the
cached .so directly, without torch's build step: see load_built); OpenMP first,
since ATen's parallel_for is inlined into the module and runs on one thread without it (a compiler without
-fopenmp, e.g. Apple clang, still gets the kernel, serial, with a warning); if nothing builds (no compiler,
ninja or headers), None and a warning naming the fallback."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvpilot")

_BUILDS = (("-fopenmp",), ())
# first in every module, instead of the <torch/extension.h> torch would add (about a quarter of its parse time)
PRELUDE = Path(__file__).parent / "csrc" / "torch_prelude.h"
# torch serializes builds with a lock file in the build directory and waits, without limit, while it exists; a
# process killed while holding it (Ctrl-C during start-up, a killed test) left every later start hanging at
# "loading". Holding it with the module built is a no-op check (well under a second); a real build took up to
# 4 minutes on a loaded 2-core box (docs/deploy.md).
STALE_CHECK_LOCK_S = 60.0
STALE_BUILD_LOCK_S = 900.0


@dataclass(frozen=True)
class CppKernel:
    """One kernel module: `sources` concatenated in order into one translation unit (the headers are not on
    an include path); `serial` / `fallback` finish the warnings ("... runs on one thread", "using ...")."""

    label: str
    name_prefix: str
    sources: tuple[Path, ...]
    functions: tuple[str, ...]
    cflags: tuple[str, ...]
    serial: str
    fallback: str


def build_cpp_kernel(kernel: CppKernel) -> Any | None:
    """The compiled module, or None when it cannot be built or KVPILOT_CPU_KERNELS=0."""
    if os.environ.get("KVPILOT_CPU_KERNELS", "1") == "0":
        return None
    source = "\n".join(path.read_text(encoding="utf-8") for path in (PRELUDE, *kernel.sources))
    name = module_name(kernel, source, cpu_identity(), build_identity())
    error: Exception | None = None
    for openmp in _BUILDS:
        try:
            from torch.utils.cpp_extension import _get_build_directory, load_inline

            built = name if openmp else name + "_serial"
            build_dir = Path(_get_build_directory(built, verbose=False))
            wait_for_other_build(kernel, build_dir, built)
            cached = load_built(build_dir, built)
            if cached is not None:
                return cached
            started = _announce_compile(kernel, build_dir, built)
            module = load_inline(name=built, cpp_sources=[source], no_implicit_headers=True,
                                 functions=list(kernel.functions), extra_cflags=[*kernel.cflags, *openmp],
                                 extra_ldflags=list(openmp), verbose=False)
        except Exception as exc:  # no compiler / ninja / headers / OpenMP: try the next build, then give up
            error = exc
            continue
        if started is not None:
            logger.info("%s built in %.0f s", kernel.label, time.monotonic() - started)
        if not openmp:
            logger.warning("%s built without OpenMP: %s", kernel.label, kernel.serial)
        return module
    logger.warning("%s unavailable, %s (%s: %s)", kernel.label, kernel.fallback, type(error).__name__,
                   str(error).splitlines()[0] if str(error) else "")
    return None


def _announce_compile(kernel: CppKernel, build_dir: Path, built: str) -> float | None:
    """Logs that `kernel` is being compiled when no build of it is cached (a first start on this machine, or
    after an upgrade), so a silent minute has a reason; returns the start time, None when it is cached."""
    if (build_dir / f"{built}.so").is_file():
        return None
    logger.info("compiling %s for this CPU: once, cached in %s (a minute or two on a small machine)",
                kernel.label, build_dir.parent)
    return time.monotonic()


def wait_for_other_build(kernel: CppKernel, build_dir: Path, built: str, poll_s: float = 0.25) -> None:
    """Returns once no process holds torch's build lock in `build_dir`, saying once that it waits (another
    process, e.g. a second server started beside this one, is building the same module). torch's own wait
    (inside load_inline) is silent and endless; this one ends when the lock's holder finishes or when the lock
    turns stale (remove_stale_lock: its holder was killed)."""
    lock = build_dir / "lock"
    announced = False
    while lock.exists() and not remove_stale_lock(build_dir, built):
        if not announced:
            logger.info("waiting for another process building %s (its lock: %s)", kernel.label, lock)
            announced = True
        time.sleep(poll_s)


def load_built(build_dir: Path, module_name: str) -> Any | None:
    """The module already built in `build_dir`, imported from its .so; None when there is none or a build holds
    torch's lock there (then load_inline waits for it). Skips load_inline's own check: it rewrites the build file
    with this environment's include paths, and ninja then rebuilds a module another environment built."""
    path = build_dir / f"{module_name}.so"
    if not path.is_file() or (build_dir / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_name(kernel: CppKernel, source: str, cpu: str, build: str = "") -> str:
    """The prefix and a hash of the source and `build` (build_identity()); for -march=native builds also of
    `cpu`: such a binary runs only where it was built, and a cache shared across machines (a home directory, an
    image) must not hand it to another CPU."""
    native = cpu if "-march=native" in kernel.cflags else ""
    flags = " ".join(kernel.cflags)  # a cached module is loaded without ninja's check of the build command
    return kernel.name_prefix + hashlib.sha256((source + native + build + flags).encode()).hexdigest()[:12]


def build_identity() -> str:
    """What the module's binary depends on besides its source: torch's version and build (its headers and ABI)
    and Python's ABI, not where they are installed: a fresh clone or virtual environment with the same torch
    loads the module built once (a fresh clone of the suite rebuilt all six, over a minute on 2 cores)."""
    import torch

    return "\n".join([torch.__version__, torch.version.git_version or "", str(torch.compiled_with_cxx11_abi()),
                      sysconfig.get_config_var("SOABI") or "", sysconfig.get_python_version()])


def cpu_identity() -> str:
    """This CPU's model name and feature flags (Linux /proc/cpuinfo), else what `platform` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or f"{platform.machine()} {platform.processor()}"


def remove_stale_lock(build_dir: Path, module_name: str, now: float | None = None) -> bool:
    """Deletes torch's build lock in `build_dir` when no live build can hold it: older than STALE_CHECK_LOCK_S
    with the module already built, or than STALE_BUILD_LOCK_S without. Returns whether it did (and warns)."""
    lock = build_dir / "lock"
    try:
        age_s = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    built = (build_dir / f"{module_name}.so").exists()
    if age_s < (STALE_CHECK_LOCK_S if built else STALE_BUILD_LOCK_S):
        return False
    logger.warning("removing a stale kernel build lock left by a stopped process (%.0f s old): %s", age_s, lock)
    lock.unlink(missing_ok=True)
    return True
