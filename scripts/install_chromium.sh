#!/usr/bin/env bash
# Installs Debian's chromium for the headless HTML-report test of `kvpilot bench` (tests/bench).
# Idempotent: does nothing when chromium is already on PATH.
set -euo pipefail
command -v chromium >/dev/null 2>&1 || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium)
command -v chromium
