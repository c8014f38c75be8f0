"""Every client error comes back in the OpenAI format with its status, the field named and what to do."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_malformed_json_is_400(http) -> None:
    response = http.post("/v1/completions", content=b'{"model": "x", "prompt": ',
                         headers={"Content-Type": "application/json"})
    assert "malformed JSON" in _error(response, 400)["message"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "hi", "temperature": -1}, "temperature", "must be >= 0"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", "integer"),
    ({"max_tokens": 3}, "prompt", "Field required"),
    ({"prompt": "hi", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": [99999999]}, "prompt", "outside the vocabulary"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs", "less than or equal to 20"),
])
def test_invalid_parameters_name_the_field(http, body: dict, param: str, words: str) -> None:
    error = _error(http.post("/v1/completions", json={"model": MODEL, **body}), 400)
    assert error["param"] == param and words in error["message"]


def test_chat_without_messages_is_400(http) -> None:
    error = _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
    assert error["param"] == "messages"


def test_too_long_states_both_numbers_and_the_limit(http) -> None:
    prompt = list(range(100, 1100))  # 1000 tokens
    error = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 100}), 400)
    assert "1000 tokens" in error["message"] and "max_tokens is 100" in error["message"]
    assert "1024" in error["message"] and error["type"] == "context_length_exceeded"


def test_unknown_model_is_404(http) -> None:
    error = _error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert "gpt-9" in error["message"] and MODEL in error["message"]


def test_wrong_or_missing_api_key_is_401(live_server) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    missing = httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=30)
    wrong = httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=30,
                       headers={"Authorization": "Bearer nope"})
    for response in (missing, wrong):
        assert "API key" in _error(response, 401)["message"]
    assert httpx.get(f"{live_server.url}/health", timeout=30).status_code == 200  # ops routes stay open


def test_openai_sdk_raises_its_own_error_types(openai_client) -> None:
    import openai

    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="nope", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        openai_client.completions.create(model=MODEL, prompt="hi", max_tokens=5000)
