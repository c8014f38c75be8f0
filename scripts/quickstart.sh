#!/usr/bin/env bash
# One command: install everything, then start kvpilot on the embedded SmolLM2-135M-Instruct model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${KVPILOT_VENV:-.venv}/bin/kvpilot" chat "$@"
