"""A live kvpilot server on the real embedded model (float32), started once per test session.

It runs as `kvpilot serve` does by default: the engine core in its own process (which loads the weights
itself), the HTTP side on 127.0.0.1 and a free port in a background thread. Tests that need special flags
start their own; those that share the session's `llm_fp32` weights run the core in a thread
(`ServerArgs(engine_process=False)`), since weights in this process cannot be handed to another.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvpilot.launch.args import EngineArgs
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer

API_KEY = "test-key"
MODEL = "smollm2-test"


def server_engine_args(**overrides: object) -> EngineArgs:
    settings: dict[str, object] = dict(dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)
    settings.update(overrides)
    return EngineArgs(**settings)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def live_server() -> Iterator[BackgroundServer]:
    app = create_app(engine_factory(server_engine_args(), warmup=True),
                     ServerArgs(served_model_names=(MODEL, "alias"), api_key=API_KEY))
    with BackgroundServer(app) as server:
        yield server


def authed_http(server: BackgroundServer) -> httpx.Client:
    """An HTTP client of `server` that sends the tests' API key."""
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def openai_sdk(server: BackgroundServer):
    """The OpenAI SDK pointed at `server`, no retries (a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture()
def http(live_server: BackgroundServer) -> Iterator[httpx.Client]:
    with authed_http(live_server) as client:
        yield client


@pytest.fixture()
def openai_client(live_server: BackgroundServer):
    client = openai_sdk(live_server)
    yield client
    client.close()
