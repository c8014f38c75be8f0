"""Issue 43: /openapi.json says what the server accepts. Each body below is judged twice, by the JSON schema the
server publishes (jsonschema, draft 2020-12, as generated clients and schemathesis read it) and by the server's
own request models (pydantic, then the per-role and between-field checks a route runs before the engine), and
the two verdicts must agree. No engine runs: the app is built, never started (TokenId has no maximum then)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from kvpilot.launch.args import EngineArgs
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.openai.errors import APIError
from kvpilot.server.openai.openapi_contract import _honest
from kvpilot.server.prompt_tokens import check_token_id_fields, tokenize_request
from kvpilot.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.server.openai.tokenize_routes import DetokenizeRequest, TokenizeRequest
from tests.server.tiny_server import write_tiny_config

USER = {"role": "user", "content": "hi"}
VOCAB_SIZE = 49152  # the tiny model's (SmolLM2's)
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture(scope="module")
def openapi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    config = write_tiny_config(Path(tmp_path_factory.mktemp("tiny")))
    engine = EngineArgs(model=str(config), load_format="dummy", dtype="float32", max_model_len=64,
                        kv_cache_memory="16MiB")
    return create_app(engine_factory(engine, warmup=False), ServerArgs(engine_process=False)).openapi()


def _schema_accepts(openapi: dict[str, Any], model: str, body: dict[str, Any]) -> bool:
    schema = {"$ref": f"#/components/schemas/{model}", "components": openapi["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(body)


def _server_accepts(model: type, body: dict[str, Any]) -> bool:
    """The request model's verdict, with the checks its route makes before any engine work."""
    try:
        request = model.model_validate(body)
        if isinstance(request, (CompletionRequest, ChatCompletionRequest)):
            request.check_fields()
        if isinstance(request, TokenizeRequest):
            request.check()
    except (ValidationError, APIError):
        return False
    return True


MESSAGES = [
    ([USER], True), ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], True),
    ([{"role": "user", "content": ""}], True),  # an empty string is still content (as OpenAI)
    ([{"role": "user"}], False), ([{"role": "user", "content": None}], False),
    ([{"role": "user", "content": []}], False),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], False),
    ([{"role": "system", "content": "be brief"}, USER], True), ([{"role": "system"}, USER], False),
    ([{"role": "developer", "content": None}, USER], False),
    ([USER, {"role": "assistant", "content": "hello"}], True),
    ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}], True),
    ([USER, {"role": "assistant", "tool_calls": []}], False), ([USER, {"role": "assistant"}], False),
    ([USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}],
     True),
    ([USER, {"role": "tool"}], False),  # the issue's probe: generated 1,024 tokens
    ([USER, {"role": "tool", "content": "18 C"}], False), ([USER, {"role": "tool", "tool_call_id": "c"}], False),
    ([{"role": "user", "content": "hi", "tool_calls": [CALL]}], False),
    ([{"role": "user", "content": "hi", "tool_call_id": "c"}], False),
    ([{"role": "critic", "content": "hi"}], False), ([], False),
]


@pytest.mark.parametrize(("messages", "accepted"), MESSAGES)
def test_chat_messages_schema_and_server_agree(openapi, messages: list, accepted: bool) -> None:
    body = {"messages": messages}
    assert _server_accepts(ChatCompletionRequest, body) is accepted
    assert _schema_accepts(openapi, "ChatCompletionRequest", body) is accepted
    assert _server_accepts(TokenizeRequest, body) is accepted
    assert _schema_accepts(openapi, "TokenizeRequest", body) is accepted


COMPLETIONS = [
    ({"prompt": "hi"}, True), ({"prompt": ""}, False), ({"prompt": []}, False), ({"prompt": [[]]}, False),
    ({"prompt": ["a", ""]}, False), ({"prompt": [1, 2]}, True), ({"prompt": [[1], [2, 3]]}, True),
    ({"prompt": [-1]}, False), ({"prompt": [[1], [-1]]}, False), ({"prompt": [1.0]}, True),  # JSON Schema's integer: 1.0 is 1
    ({"prompt": [1.5]}, False), ({"prompt": "hi", "max_tokens": 2.0}, True), ({"prompt": "hi", "max_tokens": 0}, False),
    ({"prompt": "hi", "n": 2.5}, False), ({"prompt": "hi", "n": 129}, False), ({"prompt": "hi", "logprobs": 21}, False),
    ({"prompt": "hi", "suffix": "}"}, False), ({"prompt": "hi", "suffix": None}, True),
    ({"prompt": "hi", "stop": [""]}, False), ({"prompt": "hi", "stop": ""}, True),
    ({"prompt": "hi", "stop_token_ids": [-5]}, False),
    ({"prompt": "hi", "logit_bias": {"12": 5}}, True), ({"prompt": "hi", "logit_bias": {"-1": 5}}, False),
    ({"prompt": "hi", "logit_bias": {"\u0663": 5}}, False),  # an Arabic-Indic 3: int() reads it, the schema not
    ({"prompt": "hi", "logit_bias": {"12": 101}}, False),
    ({"prompt": "hi", "seed": 2**64 - 1}, True), ({"prompt": "hi", "seed": 2**64}, False),
    ({"prompt": "hi", "top_p": 0}, False), ({"prompt": "hi", "top_p": 1}, True), ({"prompt": "hi", "top_k": -2}, False),
    ({"prompt": "hi", "repetition_penalty": 0.001}, False), ({"prompt": "hi", "presence_penalty": 2.5}, False),
    ({"prompt": "hi", "min_tokens": -1}, False), ({"prompt": "hi", "temperature": -0.5}, False),
]


def _completion_accepted(body: dict[str, Any]) -> bool:
    """_server_accepts, then what serving.py checks next: token ids against the vocabulary (a text prompt needs
    the tokenizer: not here) and the sampling ranges (SamplingParams, built from the request)."""
    if not _server_accepts(CompletionRequest, body):
        return False
    request = CompletionRequest.model_validate(body)
    try:
        for one in request.prompts():
            if not isinstance(one, str):
                tokenize_request(request.model_copy(update={"prompt": one}), None, VOCAB_SIZE, 1024)
        check_token_id_fields(request, VOCAB_SIZE)
        request.sampling_params(max_tokens=request.default_max_tokens(room=1024), logprobs=request.logprobs)
    except (APIError, ValueError):
        return False
    return True


@pytest.mark.parametrize(("body", "accepted"), COMPLETIONS)
def test_completion_schema_and_server_agree(openapi, body: dict, accepted: bool) -> None:
    assert _completion_accepted(body) is accepted
    assert _schema_accepts(openapi, "CompletionRequest", body) is accepted


@pytest.mark.parametrize(("body", "accepted"), [
    ({"messages": [USER], "max_tokens": 0, "max_completion_tokens": 4}, False),  # max_completion_tokens wins
    ({"messages": [USER], "max_completion_tokens": 0}, False), ({"messages": [USER], "top_logprobs": 21}, False),
])
def test_chat_token_budgets_schema_and_server_agree(openapi, body: dict, accepted: bool) -> None:
    assert _server_accepts(ChatCompletionRequest, body) is accepted
    assert _schema_accepts(openapi, "ChatCompletionRequest", body) is accepted


@pytest.mark.parametrize(("model", "body", "accepted"), [
    (TokenizeRequest, {}, False), (TokenizeRequest, {"prompt": ""}, True), (TokenizeRequest, {"prompt": None}, False),
    (TokenizeRequest, {"prompt": "a", "messages": [USER]}, False),
    (TokenizeRequest, {"prompt": None, "messages": [USER]}, True),
    (TokenizeRequest, {"prompt": "a", "tools": []}, False),
    (TokenizeRequest, {"prompt": "a", "messages": [USER], "tools": []}, False),  # found by schemathesis
    (TokenizeRequest, {"prompt": "a", "messages": None}, True),
    (DetokenizeRequest, {"tokens": [1, 2]}, True), (DetokenizeRequest, {"tokens": []}, True),
    (DetokenizeRequest, {"tokens": [-1]}, False), (DetokenizeRequest, {}, False),
])
def test_tokenize_schema_and_server_agree(openapi, model: type, body: dict, accepted: bool) -> None:
    """/detokenize's negative ids: refused by the route's vocabulary check, which the schema's TokenId states."""
    server = _server_accepts(model, body)
    if server and model is DetokenizeRequest:
        server = all(t >= 0 for t in body["tokens"])
    assert server is accepted
    assert _schema_accepts(openapi, model.__name__, body) is accepted


def test_token_ids_share_one_component_bounded_by_the_vocabulary(openapi) -> None:
    """Every token id field refers to TokenId; once the model is known its maximum is vocab_size - 1."""
    text = str(openapi)
    assert "'title': 'TokenId'" not in text.replace(str(openapi["components"]["schemas"]["TokenId"]), "")
    assert openapi["components"]["schemas"]["TokenId"]["minimum"] == 0
    assert "maximum" not in openapi["components"]["schemas"]["TokenId"]  # the engine never started here
    bounded = _honest({"paths": {}, "components": {"schemas": {"X": {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "title": "TokenId"}}}}}}}, frozenset(), False, 49152)
    assert bounded["components"]["schemas"]["X"]["properties"]["ids"]["items"] == {
        "$ref": "#/components/schemas/TokenId"}
    assert bounded["components"]["schemas"]["TokenId"]["maximum"] == 49151
    for path, field in (("DetokenizeRequest", "tokens"), ("CompletionRequest", "stop_token_ids")):
        assert "#/components/schemas/TokenId" in str(openapi["components"]["schemas"][path]["properties"][field])
