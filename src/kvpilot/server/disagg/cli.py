"""The `kvpilot proxy` command: the standalone router of disaggregated serving (proxy.py)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvpilot.server.disagg.handoff import DEFAULT_MAX_LOCAL_PREFILL_TOKENS
from kvpilot.server.serve_flags import HostOpt, PortOpt

_URLS = "a worker's base URL, e.g. http://10.0.0.5:8000 (repeat for each)"


def proxy_command(
    prefill: Annotated[Optional[list[str]], typer.Option("--prefill", help=f"Prefill worker: {_URLS}; it runs "
                                                         "`kvpilot serve --kv-role prefill`.")] = None,
    decode: Annotated[Optional[list[str]], typer.Option("--decode", help=f"Decode worker: {_URLS}; it runs "
                                                        "`kvpilot serve --kv-role decode`.")] = None,
    worker: Annotated[Optional[list[str]], typer.Option("--worker", help=f"Mixed worker (no disaggregation: each "
                                                        f"request whole to the least busy one): {_URLS}.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for a worker to connect or to "
                                           "send its next bytes.")] = 600.0,
    max_local_prefill_tokens: Annotated[int, typer.Option(
        "--max-local-prefill-tokens", help="Prompts up to this many tokens (estimated: 4 characters a token for "
        "text) skip the prefill worker: their decode worker prefills them itself. 0: every prompt is handed "
        "off.")] = DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    host: HostOpt = "127.0.0.1", port: PortOpt = 8000,
) -> None:
    """Route OpenAI requests to kvpilot workers: prefill on one, decode on another (or least-busy mixed)."""
    import uvicorn

    from kvpilot.server.disagg.proxy import ProxyConfig, create_proxy_app
    from kvpilot.server.guards.listen import PortInUseError, bind_listener
    from kvpilot.server.guards.slow_clients import header_timeout_protocol

    config = ProxyConfig(prefill_urls=_urls(prefill), decode_urls=_urls(decode), worker_urls=_urls(worker),
                         timeout_s=timeout, max_local_prefill_tokens=max_local_prefill_tokens)
    try:
        config.check()
        listener = bind_listener(host, port)
    except (ValueError, PortInUseError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    app = create_proxy_app(config)
    typer.echo(f"kvpilot proxy: http://{host}:{port} ({'prefill -> decode' if config.disaggregated else 'mixed'})")
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, loop="asyncio",
                                  http=header_timeout_protocol(10.0))).run(sockets=[listener])


def _urls(values: Optional[list[str]]) -> tuple[str, ...]:
    return tuple(value.rstrip("/").removesuffix("/v1") for value in values or ())
