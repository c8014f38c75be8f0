"""Headless Chromium for page tests: the DOM a page has rendered, or a screenshot of it.

`--virtual-time-budget` lets the page's timers (the dashboard polls on one) run that many milliseconds of
virtual time; virtual time stands still while a fetch is in flight, so every poll gets its answer.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([str(chromium_path()), *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout_s, check=False)


def dump_dom(url: str, budget_ms: int = 3000, timeout_s: float = 120.0) -> str:
    """The page's DOM after `budget_ms` of virtual time."""
    done = _run([f"--virtual-time-budget={budget_ms}", "--dump-dom", url], timeout_s)
    assert done.returncode == 0 and done.stdout, f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def screenshot(url: str, path: Path, width: int, height: int, budget_ms: int = 3000,
               timeout_s: float = 120.0) -> Path:
    """A PNG of the page's first `width` x `height` pixels after `budget_ms` of virtual time."""
    done = _run([f"--virtual-time-budget={budget_ms}", f"--window-size={width},{height}",
                 f"--screenshot={path}", url], timeout_s)
    assert done.returncode == 0 and path.exists(), f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
    return path
