"""Virtual environments for peers under a cache directory, reused when their marker file says so.

Invariant: `<venv>/.kvpilot-peer-installed` is written only after every install step of that peer succeeded,
so a half-finished install (killed, out of disk, a failed compile) is redone from scratch next time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MARKER_NAME = ".kvpilot-peer-installed"
DEFAULT_CACHE_DIR = Path("~/.cache/kvpilot-peers").expanduser()


class InstallError(RuntimeError):
    """A peer could not be installed on this box; the message says which step failed and where its log is."""


@dataclass(frozen=True)
class PeerVenv:
    """One peer's virtual environment `<cache_dir>/<name>` and its install log `<cache_dir>/<name>-install.log`."""

    cache_dir: Path
    name: str

    @property
    def root(self) -> Path:
        return self.cache_dir / self.name

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def marker(self) -> Path:
        return self.root / MARKER_NAME

    @property
    def log_path(self) -> Path:
        return self.cache_dir / f"{self.name}-install.log"

    def is_installed(self) -> bool:
        return self.marker.is_file() and self.python.is_file()

    def site_packages(self) -> Path:
        """The venv's site-packages (found by glob: the venv's Python version need not be this one's)."""
        found = sorted(self.root.glob("lib/python3*/site-packages"))
        if not found:
            raise InstallError(f"{self.root}: no lib/python3*/site-packages; delete the folder and rerun")
        return found[0]

    def create_fresh(self) -> None:
        """Removes any earlier (unfinished) install and creates an empty venv with pip."""
        if self.root.exists():
            shutil.rmtree(self.root)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text(f"# install of {self.name} started {time.ctime()}\n")
        self.run([_base_python(), "-m", "venv", str(self.root)], "create the virtual environment")
        self.pip(["install", "--upgrade", "pip"], "upgrade pip")

    def mark_installed(self, summary: str) -> None:
        self.marker.write_text(f"{summary}\ninstalled {time.ctime()}\n")

    def pip(self, args: list[str], step: str, env: dict[str, str] | None = None) -> None:
        self.run([str(self.python), "-m", "pip", *args], step, env)

    def run(self, command: list[str], step: str, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> None:
        """Runs one install step at the lowest CPU priority (the box may be serving or testing meanwhile),
        appending its output to the install log. InstallError names the step and the log on failure."""
        with self.log_path.open("a") as log:
            log.write(f"\n$ {' '.join(command)}\n")
            log.flush()
            # Own process group: an interrupted install takes its compilers with it (a resumed build redoes
            # only what was not finished).
            process = subprocess.Popen(["nice", "-n", "19", *command], stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)
            try:
                returncode = process.wait()
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                raise
        if returncode != 0:
            raise InstallError(f"{self.name}: '{step}' failed (exit {returncode}); see {self.log_path}")


def _base_python() -> str:
    """The interpreter this venv was made from (not the kvpilot venv itself: peers must not see its packages)."""
    return getattr(sys, "_base_executable", None) or sys.executable
