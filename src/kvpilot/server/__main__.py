"""`python -m kvpilot.server ...` = `kvpilot serve ...` (usable before the main CLI registers the command)."""

import logging

import typer

from kvpilot.server.cli import serve_command

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    typer.run(serve_command)
