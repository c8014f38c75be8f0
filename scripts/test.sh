#!/usr/bin/env bash
# One command: install everything (with the test extras), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The ray extra: tests/ray start a local Ray cluster (replicas, prefix routing, lanes).
bash scripts/install.sh test,ray
PY="${KVPILOT_VENV:-.venv}/bin/python"
# The Triton kernel tests: with a CPU build of torch they run in Triton's interpreter, which needs the
# test-gpu extra (triton, a ~200 MB wheel); a CUDA build of torch ships its own triton: leave it alone.
if "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)"; then
    "$PY" -m pip install -q -e ".[test,test-gpu,ray]"
fi
bash scripts/install_chromium.sh   # headless Chromium for the bench HTML report test
exec "${KVPILOT_VENV:-.venv}/bin/python" -m pytest "$@"
