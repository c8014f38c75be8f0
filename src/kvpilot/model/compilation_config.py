"""vLLM's `--compilation-config`, the part kvpilot acts on: which steps replay CUDA graphs, and at which sizes.

kvpilot compiles nothing (its fused kernels are written by hand); what vLLM users set through this flag is the
CUDA-graph mode, which kvpilot follows by name:

- FULL_AND_PIECEWISE (the default, as vLLM's): a decode-only step replays one graph of the whole forward
  (model/cuda_graphs.py); any other step of at most max_cudagraph_capture_size tokens (decodes beside a prompt
  chunk, speculative verify steps, prompts alone) replays the forward's pieces between attention calls, with
  attention run eagerly (model/piecewise_graphs.py).
- FULL_DECODE_ONLY: the decode graphs alone; PIECEWISE: the pieces for every step; NONE: no graphs (as
  `--enforce-eager`). vLLM's FULL (whole-step graphs of mixed steps too) is refused: kvpilot's attention grid
  depends on the prompt lengths, so it cannot be captured once for all mixed steps.

Torch-free: EngineArgs checks the flag in the HTTP process before the model loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CUDAGRAPH_MODES: tuple[str, ...] = ("NONE", "FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE")
KNOWN_KEYS: tuple[str, ...] = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size")
# Mixed steps up to this many tokens replay pieces by default. Above it a step's kernels keep the GPU busy
# longer than the host takes to launch them (a 2,048-token step of Qwen3-0.6B is ~10 ms of GEMMs against
# ~465 launches of ~10 us), so a graph would save little and cost its bucket's memory.
DEFAULT_MAX_PIECEWISE_TOKENS = 2048
_STEPS_PER_OCTAVE = 8  # bucket sizes from 64 up: at most 1/8 of a replayed step is padding


@dataclass(frozen=True)
class CompilationConfig:
    """Invariants: cudagraph_mode is one of CUDAGRAPH_MODES; capture sizes, when given, are positive integers
    (vLLM's meaning: token counts; decode graphs take those <= max_num_seqs, pieces those <= the step budget)."""

    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None

    def __post_init__(self) -> None:
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            hint = " (kvpilot cannot capture whole mixed steps: FULL_AND_PIECEWISE replays their pieces)" \
                if self.cudagraph_mode == "FULL" else ""
            raise ValueError(f"compilation_config cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got "
                             f"{self.cudagraph_mode!r}{hint}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or not all(_positive_int(s) for s in sizes)):
            raise ValueError(f"compilation_config cudagraph_capture_sizes must be positive integers, got {sizes!r}")
        if self.max_cudagraph_capture_size is not None and not _positive_int(self.max_cudagraph_capture_size):
            raise ValueError("compilation_config max_cudagraph_capture_size must be a positive integer, got "
                             f"{self.max_cudagraph_capture_size!r}")

    @classmethod
    def of(cls, value: "CompilationConfig | dict[str, Any] | str | None") -> "CompilationConfig":
        """The config from vLLM's dict or its JSON text (None: the defaults); ValueError naming what is wrong."""
        if value is None or isinstance(value, CompilationConfig):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"compilation_config is not valid JSON ({exc.msg}); expected an object such as "
                                 '{"cudagraph_mode": "FULL_AND_PIECEWISE", "max_cudagraph_capture_size": 2048}') \
                    from exc
        if not isinstance(value, dict):
            raise ValueError(f"compilation_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KNOWN_KEYS))
        if unknown:
            raise ValueError(f"compilation_config keys {unknown} are not supported (kvpilot compiles nothing and "
                             f"replays CUDA graphs); it takes {', '.join(KNOWN_KEYS)}")
        sizes = value.get("cudagraph_capture_sizes")
        mode = value.get("cudagraph_mode", cls.cudagraph_mode)
        return cls(cudagraph_mode=mode.upper() if isinstance(mode, str) else mode,
                   cudagraph_capture_sizes=tuple(sizes) if isinstance(sizes, (list, tuple)) else sizes,
                   max_cudagraph_capture_size=value.get("max_cudagraph_capture_size"))

    @property
    def full_decode(self) -> bool:
        """Whether decode-only steps replay whole-forward graphs."""
        return self.cudagraph_mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

    @property
    def piecewise(self) -> bool:
        """Whether steps the decode graphs do not take replay the forward's pieces."""
        return self.cudagraph_mode in ("PIECEWISE", "FULL_AND_PIECEWISE")

    def piecewise_sizes(self, max_num_batched_tokens: int) -> list[int]:
        """The token counts the pieces are captured at, ascending, none above the step budget."""
        if self.cudagraph_capture_sizes is not None:
            return sorted({s for s in self.cudagraph_capture_sizes if s <= max_num_batched_tokens})
        largest = min(self.max_cudagraph_capture_size or DEFAULT_MAX_PIECEWISE_TOKENS, max_num_batched_tokens)
        return default_piecewise_sizes(largest)


def default_piecewise_sizes(largest: int) -> list[int]:
    """8, 16, ... 56, then 8 sizes an octave from 64 (64, 72, ... 120, 128, 144, ...), and `largest` itself:
    a step pads to the next size, at most 1/8 of its rows idle from 64 tokens up."""
    sizes = set(range(8, 64, 8))
    octave = 64
    while octave <= largest:
        sizes.update(range(octave, 2 * octave, octave // _STEPS_PER_OCTAVE))
        octave *= 2
    return sorted({s for s in sizes if s <= largest} | {largest})


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
