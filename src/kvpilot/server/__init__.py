"""kvpilot.server: the OpenAI-compatible HTTP server (`kvpilot serve`).

create_app(factory, ServerArgs) builds the FastAPI app; engine_factory(EngineArgs) builds the engine in the
engine thread; serve_command (kvpilot.server.cli) is the typer command.
"""

from kvpilot.server.app import create_app
from kvpilot.server.config import ServerArgs
from kvpilot.server.served_engine import engine_factory

__all__ = ["ServerArgs", "create_app", "engine_factory"]
