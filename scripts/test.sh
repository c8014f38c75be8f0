#!/usr/bin/env bash
# One command: install everything (with the test extras), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The ray extra: tests/ray start a local Ray cluster (replicas, prefix routing, lanes).
# The test-gpu extra: with a CPU build of torch the Triton kernel tests run in Triton's interpreter, which needs
# triton (a ~200 MB wheel); a CUDA build of torch ships its own triton: leave it alone. One pip resolve for all.
PY="${KVPILOT_VENV:-.venv}/bin/python"
EXTRAS="test,test-gpu,ray"
if [ -x "$PY" ] && "$PY" -c "import torch" 2>/dev/null; then   # a torch already there decides
    if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)"; then EXTRAS="test,ray"; fi
elif [ "$(bash scripts/install.sh --print-torch-plan)" = "cuda" ]; then
    EXTRAS="test,ray"
fi
bash scripts/install.sh "$EXTRAS"
bash scripts/install_chromium.sh   # headless Chromium for the bench HTML report test
# Bytecode once, for every Python process the suite starts (servers, engine cores, CLIs): where
# PYTHONDONTWRITEBYTECODE is set (the box of docs/benchmark-log.md's suite times) none writes it, and each one
# compiled the kvpilot modules it imports again (~250 of them: ~0.25 s of CPU). Python still reads the ignored
# __pycache__ files; a syntax error is left for pytest to report.
"$PY" -m compileall -q src tests >/dev/null || true
# The C++ CPU kernels, built (or found cached) once here, before any test: with an empty kernel cache the
# suite's first servers otherwise compiled them in several processes at once, each waiting for the other's
# lock, and a `kvpilot serve` started meanwhile sat at "loading" past its test's patience on a busy box.
"$PY" -c "import torch
from kvpilot.model.cpu_kernels import build_cpu_kernels, kernels_for
from kvpilot.model.layers.cpu_moe_kernel import get_moe_kernel
build_cpu_kernels((*kernels_for(torch.bfloat16), get_moe_kernel))"
# Two pytest workers (pytest-xdist), also on 2 cores: a one-process run left the CPUs idle a quarter of the
# time (waiting on servers, subprocesses, timed phases), two kept them ~95% busy (docs/benchmark-log.md). A
# file's tests stay on one worker (tests/conftest.py). KVPILOT_TEST_WORKERS=0 runs in one process.
WORKERS="${KVPILOT_TEST_WORKERS:-2}"
# With two workers on the cores, each engine the suite starts (in a worker, a server process, a Ray replica) runs one
# OpenMP thread: a two-thread engine beside the other worker spent much of its CPU at barriers, waiting for its
# second thread while that one had no core (the suite on a 2-core Zen 3: 1,091 -> 890 s of pytest,
# docs/benchmark-log.md). The kernel tests and the doctor's live probes set their own threads (tests/model/conftest.py,
# tests/doctor/conftest.py). A user's OMP_NUM_THREADS wins.
if [ "$WORKERS" != "0" ]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
exec "$PY" -m pytest -n "$WORKERS" --dist loadgroup "$@"
