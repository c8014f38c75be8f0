"""The engine's scheduler layer and the server import kvpilot.fit: it must not pull in torch."""

from __future__ import annotations

import subprocess
import sys


def test_fit_package_imports_without_torch() -> None:
    code = (
        "import sys, kvpilot.fit.cli, kvpilot.fit.plan, kvpilot.fit.kv_cache, kvpilot.fit.server_capacity\n"
        "from kvpilot.fit.model_source import load_model\n"
        "load_model('smollm2-135m')\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"
