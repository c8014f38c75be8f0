#!/usr/bin/env bash
# One command: install everything, then start the OpenAI-compatible server (http://127.0.0.1:8000) on the
# embedded SmolLM2-135M-Instruct model. Extra arguments go to `kvpilot serve` (e.g. --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${KVPILOT_VENV:-.venv}/bin/kvpilot" serve "$@"
