"""EngineSpec: how to build the served engine, as data, so it can be sent to the engine core process.

Torch-free on purpose: the HTTP side builds and pickles it; only the core calls it (which imports the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kvpilot.launch.args import EngineArgs
    from kvpilot.server.core.served_engine import ServedEngine

EngineFactory = Callable[[], "ServedEngine"]
"""Anything that builds a ServedEngine; in the core thread any callable works, the core process needs an
EngineSpec without `loaded` (it is pickled to the child)."""


@dataclass(frozen=True)
class EngineSpec:
    """Build an engine from `args` and warm it up. `loaded` (a LoadedModel) reuses weights already in this
    process (tests, benchmarks): such a spec cannot be sent to a process, so its core runs in a thread."""

    args: EngineArgs
    loaded: Any = None
    warmup: bool = True

    @property
    def crosses_processes(self) -> bool:
        return self.loaded is None

    def __call__(self) -> ServedEngine:
        from kvpilot.server.core.served_engine import build_served_engine

        return build_served_engine(self.args, self.loaded, self.warmup)


def engine_factory(args: EngineArgs, loaded: Any = None, warmup: bool = True) -> EngineSpec:
    """The engine a server runs: loads the model (or reuses `loaded`'s weights), builds it, warms it up."""
    return EngineSpec(args, loaded, warmup)
