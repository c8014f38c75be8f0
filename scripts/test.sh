#!/usr/bin/env bash
# One command: install everything (with the test extras), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
bash scripts/install_chromium.sh   # headless Chromium for the bench HTML report test
exec "${KVPILOT_VENV:-.venv}/bin/python" -m pytest "$@"
