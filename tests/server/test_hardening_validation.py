"""Issue 14, part A: nothing a client sends reaches the engine unchecked. Each payload below once killed the
engine loop, leaked a 500 or was silently coerced; now each is a 400 in the OpenAI format naming the field,
and the server keeps serving (integrity holds, nothing left running)."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from kvpilot.outputs import TokenLogprob
from kvpilot.server.openai.responses import chat_logprobs, completion_logprobs
from tests.server.conftest import MODEL

HUGE = 100000000000000000000


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status  # one code type everywhere: the HTTP status, as vLLM sends it
    return error


COMPLETIONS = [
    ({"top_k": HUGE}, "top_k", "top_k must be 0 or -1 (off) or 1.."),
    ({"seed": HUGE}, "seed", "seed must be in 0..2**64-1"),
    ({"seed": -HUGE}, "seed", "seed must be in 0..2**64-1"),
    ({"min_tokens": 1, "stop_token_ids": [999999]}, "stop_token_ids", "outside the vocabulary"),
    ({"min_tokens": 1, "stop_token_ids": [HUGE]}, "stop_token_ids", "outside the vocabulary"),
    ({"repetition_penalty": 1e-320, "logprobs": 1}, "repetition_penalty", "must be in [0.01, 100]"),
    ({"repetition_penalty": 1e-320, "logprobs": 1, "stream": True}, "repetition_penalty", "must be in"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"12": 101}}, "logit_bias", "must be in [-100, 100]"),
    ({"max_tokens": "8"}, "max_tokens", "valid integer"),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": [[False]]}, "prompt", "fits none of the accepted types"),
    ({"prompt": "\ud800"}, "prompt", "lone UTF-16 surrogate"),
    ({"stop": ["ok\udc00"]}, "stop.0", "lone UTF-16 surrogate"),
    ({"temperature": math.nan}, "temperature", "finite number"),
    ({"suffix": "}"}, "suffix", "suffix is not supported"),  # else the middle is silently not filled
    ({"top_p": math.inf}, "top_p", "finite number"),
    # issue 43: what the schema says, the server does (and the reverse: tests/server/test_openapi_contract.py)
    ({"prompt": ""}, "prompt", "the prompt is empty"),
    ({"prompt": ["Hello", ""]}, "prompt.1", "the prompt is empty"),
    ({"prompt": [[1, 2], []]}, "prompt.1", "the prompt is empty"),
    ({"max_tokens": 2.5}, "max_tokens", "valid integer"),
    ({"logit_bias": {"\u0663": 1}}, "logit_bias", "keys must be token ids"),  # int() would read it as 3
]


@pytest.mark.parametrize(("fields", "param", "words"), COMPLETIONS)
def test_completions_payloads_are_400_naming_the_field(http, fields: dict, param: str, words: str) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}
    error = _error(http.post("/v1/completions", content=json.dumps(body),
                             headers={"Content-Type": "application/json"}), 400)
    assert error["param"] == param and words in error["message"], error


CHAT = [
    ({"top_k": 9223372036854775808}, "top_k", "top_k must be"),
    ({"seed": -1}, "seed", "seed must be in"),
    ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content", "lone UTF-16 surrogate"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages.0.content.0.text", "lone UTF-16 surrogate"),
    ({"logprobs": "yes"}, "logprobs", "valid boolean"),
    ({"top_logprobs": 3}, "top_logprobs", "needs logprobs=true"),  # else silently no logprobs
    # a text-only model must not answer as if the image were not there
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages.0.content", "content part 1 has type 'image_url': the models served here read text only"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content", "needs a string 'text'"),
    ({"model": "gpt\ud800"}, "model", "lone UTF-16 surrogate"),
    # issue 43: each role's rules, as OpenAI's (these once generated up to max_tokens from an empty turn)
    ({"messages": [{"role": "tool"}]}, "messages.0.content", "a 'tool' message needs content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "a 'user' message needs content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0.content", "empty list of parts"),
    ({"messages": [{"role": "system"}, {"role": "user", "content": "Hi"}]}, "messages.0.content",
     "a 'system' message needs content"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant"}]}, "messages.1.content",
     "needs content or tool_calls"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "18 C"}]}, "messages.1.tool_call_id",
     "needs tool_call_id"),
    ({"messages": [{"role": "critic", "content": "Hi"}]}, "messages.0.role", "'system', 'user', 'assistant'"),
    ({"max_tokens": 0, "max_completion_tokens": 4}, "max_tokens", "max_tokens must be >= 1"),
]


@pytest.mark.parametrize(("fields", "param", "words"), CHAT)
def test_chat_payloads_are_400_naming_the_field(http, fields: dict, param: str, words: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    error = _error(http.post("/v1/chat/completions", content=json.dumps(body),
                             headers={"Content-Type": "application/json"}), 400)
    assert error["param"] == param and words in error["message"], error


def test_over_long_chat_prompt_without_max_tokens_blames_the_messages(http) -> None:
    text = "word " * 2000  # well over max_model_len (1024) tokens
    error = _error(http.post("/v1/chat/completions",
                             json={"model": MODEL, "messages": [{"role": "user", "content": text}]}), 400)
    assert error["param"] == "messages" and error["type"] == "context_length_exceeded"
    assert "the prompt has" in error["message"] and "1024" in error["message"]
    assert "max_tokens is 1" not in error["message"]


def test_an_integer_where_a_number_is_expected_is_still_accepted(http) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                  "temperature": 0, "top_p": 1, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_an_integral_number_where_an_integer_is_expected_is_accepted(http) -> None:
    """JSON Schema's integer (what /openapi.json says) includes 2.0; a JavaScript client cannot even send 2."""
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2.0, 3], "max_tokens": 2.0,
                                                  "temperature": 0, "ignore_eos": True, "n": 1.0})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 2)


def test_every_payload_left_the_engine_serving(http) -> None:
    for fields, _, _ in COMPLETIONS:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}
        http.post("/v1/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5,
                                                  "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
    integrity = http.get("/v1/kvpilot/integrity").json()
    assert integrity["ok"] and integrity["num_running"] == integrity["num_waiting"] == 0


class _Ids:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return f"t{token_ids[0]}"


def test_logprobs_are_never_nan_or_inf_in_json() -> None:
    entries = [TokenLogprob(1, math.nan, [(1, math.nan), (2, -math.inf)]), TokenLogprob(2, -math.inf, [])]
    for shape in (completion_logprobs(entries, _Ids()), chat_logprobs(entries, _Ids())):
        text = json.dumps(shape, allow_nan=False)  # raises on NaN / inf
        assert "-9999.0" in text
