"""kvpilot.server: the OpenAI-compatible HTTP server (`kvpilot serve`).

create_app(factory, ServerArgs) builds the FastAPI app; engine_factory(EngineArgs) says how the engine core
(its own process by default) builds the engine; serve_command (kvpilot.server.cli) is the typer command. The
exports load lazily: the app pulls in the engine's modules, and `kvpilot --help` must not.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerArgs", "create_app", "engine_factory"]
_EXPORTS = {"create_app": "kvpilot.server.app", "ServerArgs": "kvpilot.server.config",
            "engine_factory": "kvpilot.server.core.engine_spec"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvpilot.server' has no attribute {name!r}")
