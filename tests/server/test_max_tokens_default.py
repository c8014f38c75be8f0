"""Issue 14: a request that sends no max_tokens stops at the server's --max-tokens-default (1024 unless told;
0 = vLLM's "the rest of max_model_len"), visible as finish_reason "length" and in usage; a client's own
max_tokens is never capped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvpilot.server.config import ServerArgs, ServerConfigError
from tests.server.tiny_server import AUTH, KEY, MODEL, tiny_server, write_tiny_config

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_config(tmp_path_factory.mktemp("tiny"), narrow=True)  # the uncapped request: ~250 steps


def _chat(client: httpx.Client, **fields: object) -> dict:
    response = client.post("/v1/chat/completions", headers=AUTH,
                           json={"model": MODEL, "messages": HELLO, "ignore_eos": True, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_default_cap_is_1024_and_validated() -> None:
    assert ServerArgs().max_tokens_default == 1024
    assert ServerArgs(max_tokens_default=None).max_tokens_default is None
    with pytest.raises(ServerConfigError, match="--max-tokens-default"):
        ServerArgs(max_tokens_default=0)
    result = subprocess.run([sys.executable, "-m", "kvpilot.cli", "serve", "--max-tokens-default", "-3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--max-tokens-default must be >= 1 (or 0 for no cap)" in result.stderr


def test_requests_without_max_tokens_stop_at_the_cap(tiny_config: Path) -> None:
    with tiny_server(tiny_config, api_key=KEY, max_tokens_default=7) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        capped = _chat(client)
        assert capped["usage"]["completion_tokens"] == 7 and capped["choices"][0]["finish_reason"] == "length"
        stream = client.post("/v1/completions", headers=AUTH, json={
            "model": MODEL, "prompt": "hi", "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}})
        assert '"completion_tokens":7' in stream.text.replace(" ", "")  # min(OpenAI's 16, the cap)
        own = _chat(client, max_tokens=12)  # the client's own value is never capped
        assert own["usage"]["completion_tokens"] == 12
        own = _chat(client, max_completion_tokens=9)
        assert own["usage"]["completion_tokens"] == 9


def test_no_cap_fills_max_model_len_like_vllm(tiny_config: Path) -> None:
    with tiny_server(tiny_config, api_key=KEY, max_tokens_default=None) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        body = _chat(client)
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 256  # tiny_server's max_model_len
    assert body["choices"][0]["finish_reason"] == "length"
