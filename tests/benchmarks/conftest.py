"""The benchmark scripts import their siblings by bare name (`from peers.report import ...`, `from hf_mirror
import ...`), as when run as `python benchmarks/x.py`: put benchmarks/ on sys.path for these tests."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
