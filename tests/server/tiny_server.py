"""A live server on a 2-layer dummy-weight SmolLM2 (the embedded tokenizer, random weights): the real HTTP
stack, engine, scheduler and KV cache at a few milliseconds a token, for the hardening and reliability tests.
The engine core runs in a thread (no second process to spawn)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvpilot.launch.args import EngineArgs
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer

MODEL = "tiny"
KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def write_tiny_config(directory: Path, narrow: bool = False) -> Path:
    """SmolLM2's config cut to 2 layers (its vocabulary: the embedded tokenizer fits). `narrow`: also cut to
    width 64 (2 heads of 32, one KV head), for tests that need many tokens, not the model's shapes: a decode
    step then costs ~1.4 ms instead of ~9 (the 49k-row output layer shrinks with the width)."""
    config = get_hf_config("smollm2-135m")
    config["num_hidden_layers"] = 2
    if narrow:
        config.update(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32)
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


@contextmanager
def tiny_server(config: Path, engine: dict | None = None, **server: object) -> Iterator[BackgroundServer]:
    settings: dict[str, object] = dict(model=str(config), load_format="dummy", dtype="float32",
                                       max_model_len=256, kv_cache_memory="32MiB")
    settings.update(engine or {})
    server.setdefault("served_model_names", (MODEL,))
    server.setdefault("engine_process", False)
    app = create_app(engine_factory(EngineArgs(**settings), warmup=False), ServerArgs(**server))  # type: ignore[arg-type]
    with BackgroundServer(app, timeout_s=120) as running:
        yield running


def integrity(client: httpx.Client) -> dict:
    response = client.get("/v1/kvpilot/integrity")
    response.raise_for_status()
    return response.json()
