"""scripts/test.sh's two pytest workers keep each group of tests (tests/conftest.py, suite_group) on one worker.

xdist's own `--dist loadgroup` stopped doing so silently under pytest 9.2 (it tags tests through an attribute
pytest no longer reads): here a small suite laid out like this one runs under the same command and hook, and
each test writes down the worker that ran it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

CONFTEST = Path(__file__).parent / "conftest.py"
# the files of the small suite, by the group each belongs to
FILES = {"tests/ray/test_one.py": "live-timing", "tests/ray/test_two.py": "live-timing",
         "tests/doctor/test_live_one.py": "live-timing", "tests/doctor/test_live_two.py": "live-timing",
         "tests/engine_e2e/test_batching.py": "engine_e2e-alone",
         "tests/engine_e2e/test_speculative.py": "engine_e2e-alone",
         "tests/model/test_three.py": "tests/model/test_three.py", "tests/model/test_four.py": "tests/model/test_four.py"}
TEST = '''
import os
import time
import pytest


@pytest.mark.parametrize("i", range(4))
def test_records_its_worker(i):
    time.sleep(0.05)  # long enough that the other worker asks for work meanwhile
    with open(os.environ["GROUPS_OUT"], "a") as out:
        out.write(f"{__file__} {os.environ['PYTEST_XDIST_WORKER']}\\n")
'''


def test_each_group_runs_on_one_worker_and_both_workers_run(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    for name in FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(TEST)
    # this suite's hook, loaded from its file (the small suite's own `tests` package would shadow ours)
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('kvpilot_suite_conftest', {str(CONFTEST)!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "pytest_xdist_make_scheduler = suite.pytest_xdist_make_scheduler\n")
    out = tmp_path / "workers.txt"
    # xdist alone of the installed plugins (hypothesis's and schemathesis's took seconds to start in each worker)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "xdist", "-n", "2", "--dist", "loadgroup", "-p",
                          "no:cacheprovider", "-q", "--rootdir", str(tmp_path), *FILES], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={**_outer_env(), "GROUPS_OUT": str(out), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for line in out.read_text().splitlines():
        path, worker = line.rsplit(" ", 1)
        workers[FILES[str(Path(path).relative_to(tmp_path))]].add(worker)
    assert all(len(ran_on) == 1 for ran_on in workers.values()), dict(workers)
    assert set().union(*workers.values()) == {"gw0", "gw1"}, dict(workers)


def _outer_env() -> dict[str, str]:
    """This process's environment without this run's pytest-xdist variables (the small suite has its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
