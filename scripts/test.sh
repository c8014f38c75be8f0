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
exec "$PY" -m pytest "$@"
