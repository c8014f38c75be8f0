"""POST /tokenize and /detokenize on the live server: the ids the model's tokenizer gives (and a completion
runs on), the round trip, vLLM's response shapes, the errors naming their field, the API key, and the work
done in the tokenizer pool's threads."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

import kvpilot.server.openai.tokenize_routes as tokenize_routes
from tests.server.conftest import MODEL

TEXT = "The capital of France is Paris. Héllo wörld ✓ 日本語"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_tokenize_prompt_matches_the_model_tokenizer(http, llm_fp32) -> None:
    reply = http.post("/tokenize", json={"model": MODEL, "prompt": TEXT})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["tokens"] == llm_fp32.tokenizer.encode(TEXT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    plain = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["tokens"] == llm_fp32.tokenizer.encode(TEXT, add_special_tokens=False)
    # The same ids a completion of the prompt runs on.
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": TEXT, "max_tokens": 1,
                                                    "temperature": 0}).json()
    assert completion["usage"]["prompt_tokens"] == body["count"]


def test_tokenize_messages_matches_the_chat_prompt(http, llm_fp32) -> None:
    body = http.post("/tokenize", json={"messages": QUESTION}).json()
    assert body["tokens"] == llm_fp32.tokenizer.encode_chat(QUESTION, True)
    without = http.post("/tokenize", json={"messages": QUESTION, "add_generation_prompt": False}).json()
    assert without["tokens"] == llm_fp32.tokenizer.encode_chat(QUESTION, False)
    assert without["count"] < body["count"]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]


def test_detokenize_round_trip(http, llm_fp32) -> None:
    tokens = http.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
    reply = http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert reply.status_code == 200 and reply.json() == {"prompt": TEXT}
    special = llm_fp32.tokenizer.encode_chat(QUESTION, True)
    text = http.post("/detokenize", json={"tokens": special}).json()["prompt"]
    assert text == llm_fp32.tokenizer.decode(special, skip_special_tokens=False) and "<|im_start|>" in text
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_a_prompt_over_max_model_len_is_still_counted(http) -> None:
    body = http.post("/tokenize", json={"prompt": "word " * 3000}).json()
    assert body["count"] > body["max_model_len"] and len(body["tokens"]) == body["count"]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), [
    ("/detokenize", {"tokens": [1, 99999999]}, 400, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens.0", "integer"),
    ("/detokenize", {}, 400, "tokens", "Field required"),
    ("/tokenize", {}, 400, "prompt", "neither"),
    ("/tokenize", {"prompt": "a", "messages": QUESTION}, 400, "prompt", "both"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "string"),
    ("/tokenize", {"messages": []}, 400, "messages", "at least 1"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt", "surrogate"),
    ("/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "model", "gpt-9"),
    ("/detokenize", {"model": "gpt-9", "tokens": [1]}, 404, "model", "gpt-9"),
])
def test_errors_name_the_field(http, path: str, body: dict, status: int, param: str, words: str) -> None:
    # json.dumps escapes a lone surrogate as \\ud800 (httpx's json= cannot encode it at all).
    reply = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_needs_the_api_key(live_server) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        reply = httpx.post(f"{live_server.url}{path}", json=body, timeout=30)
        assert reply.status_code == 401 and "API key" in reply.json()["error"]["message"]


def test_work_runs_in_the_tokenizer_pool(http, monkeypatch) -> None:
    threads: list[str] = []

    def recorded(real):
        def wrapper(*args):
            threads.append(threading.current_thread().name)
            return real(*args)
        return wrapper

    monkeypatch.setattr(tokenize_routes, "tokenize_ids", recorded(tokenize_routes.tokenize_ids))
    monkeypatch.setattr(tokenize_routes, "detokenize_text", recorded(tokenize_routes.detokenize_text))
    tokens = http.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == TEXT
    assert len(threads) == 2 and all(name.startswith("kvpilot-tokenize") for name in threads), threads


def test_listed_in_the_openapi_schema(http) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    for path in ("/tokenize", "/detokenize"):
        responses = paths[path]["post"]["responses"]
        assert {"400", "401", "404", "503"} <= set(responses) and "422" not in responses


def test_openapi_states_what_the_routes_refuse(http, live_server) -> None:
    """Issue 43: `{}` to /tokenize and ids past the vocabulary to /detokenize were schema-valid 400s."""
    schema = http.get("/openapi.json").json()["components"]["schemas"]
    vocab_size = live_server.state.info.vocab_size
    assert schema["TokenId"]["minimum"] == 0 and schema["TokenId"]["maximum"] == vocab_size - 1
    assert schema["DetokenizeRequest"]["properties"]["tokens"]["items"] == {"$ref": "#/components/schemas/TokenId"}
    assert [branch["required"] for branch in schema["TokenizeRequest"]["oneOf"]] == [["prompt"], ["messages"]]
    reply = http.post("/detokenize", json={"tokens": [vocab_size - 1, vocab_size]})
    assert reply.status_code == 400 and f"[{vocab_size}]" in reply.json()["error"]["message"]
    assert http.post("/detokenize", json={"tokens": [vocab_size - 1]}).status_code == 200
