"""kvpilot itself as an engine of the comparison: `kvpilot serve` (as `python -m kvpilot.server`) with its
defaults (the embedded GGUF, dtype auto) plus the contender's weights and whatever `--kvpilot-arg` adds."""

from __future__ import annotations

import sys
from pathlib import Path

from peers.quantize import REQUANTIZED_MIXES
from peers.servers import ServerSpec


def kvpilot_server_spec(port: int, num_threads: int, extra_args: list[str]) -> ServerSpec:
    """kvpilot has no threads flag: torch reads OMP_NUM_THREADS at import."""
    command = [sys.executable, "-m", "kvpilot.server", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    return ServerSpec("kvpilot", command, {"OMP_NUM_THREADS": str(num_threads)}, port, "/health")


def kvpilot_weight_args(weights: str, requantized: Path | None) -> list[str]:
    """`kvpilot serve` arguments for a contender's weights: none for the embedded GGUF as shipped; bf16 is the
    same GGUF dequantized at load (dense bf16 GEMMs everywhere); a requantized copy (`requantized`, e.g. the
    Q4_0 or Q4_K_M file) is served with the defaults (its blocks packed)."""
    if weights == "embedded":
        return []
    if weights == "bf16":
        return ["--quantization", "none", "--dtype", "bfloat16"]
    if weights in REQUANTIZED_MIXES:
        if requantized is None:
            raise ValueError(f"the {weights} contender needs the {REQUANTIZED_MIXES[weights].name} copy of the "
                             "GGUF; it was not made")
        return ["--model", str(requantized)]
    raise ValueError(f"unknown weights {weights!r}: embedded, bf16 or one of {', '.join(REQUANTIZED_MIXES)}")
