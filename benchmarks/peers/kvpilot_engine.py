"""kvpilot itself as an engine of the comparison: `kvpilot serve` (as `python -m kvpilot.server`) with its
defaults (the embedded GGUF, dtype auto) plus whatever `--kvpilot-arg` adds."""

from __future__ import annotations

import sys

from peers.servers import ServerSpec


def kvpilot_server_spec(port: int, num_threads: int, extra_args: list[str]) -> ServerSpec:
    """kvpilot has no threads flag: torch reads OMP_NUM_THREADS at import."""
    command = [sys.executable, "-m", "kvpilot.server", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    return ServerSpec("kvpilot", command, {"OMP_NUM_THREADS": str(num_threads)}, port, "/health")
