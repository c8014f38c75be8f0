"""Structured outputs, forced tool calls and logit_bias over HTTP, on the live server (real embedded model):
response_format json_schema / json_object, vLLM's guided_* extras, tool_choice named and "required"
(non-streaming and streaming; arguments keep to the tool's schema, no key repeated), the OpenAI SDK's parse()
with a pydantic model, and the 400s that name the field for what is malformed or not supported."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from pydantic import BaseModel

from kvpilot.fit.gguf_metadata import open_gguf
from kvpilot.model.tokenizer import tokenizer_from_gguf
from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "price": {"type": "integer", "minimum": 1, "maximum": 999},
                                         "in_stock": {"type": "boolean"}},
        "required": ["name", "price", "in_stock"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _chat(http, **fields) -> dict:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_response_format_json_schema_validates_for_20_prompts(http) -> None:
    things = ["a lamp", "a bike", "tea", "a phone", "shoes", "a desk", "a pen", "bread", "a guitar", "a book",
              "a kettle", "a chair", "soap", "a hat", "a map", "a clock", "rice", "a bag", "a rug", "a mug"]
    rf = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM, "strict": True}}

    def ask(thing: str) -> dict:
        return _chat(http, messages=[{"role": "user", "content": f"Describe {thing} for a shop catalog."}],
                     response_format=rf, temperature=0.7, seed=len(thing))

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, things))
    for answer in answers:
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), ITEM)


def test_json_object_and_guided_extras(http) -> None:
    obj = _chat(http, response_format={"type": "json_object"}, max_tokens=40,
                messages=[{"role": "user", "content": 'What is 2+2? Answer as JSON like {"answer": 0}.'}])
    assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)
    choice = _chat(http, guided_choice=["sunny", "rainy"])["choices"][0]["message"]["content"]
    assert choice in ("sunny", "rainy")
    body = {"model": MODEL, "prompt": "Order number:", "max_tokens": 12, "temperature": 0,
            "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{4}"}}
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert len(text) == 7 and text[2] == "-" and text[:2].isupper() and text[3:].isdigit(), text


def _check_call(call: dict, name: str, schema: dict) -> None:
    assert call["type"] == "function" and call["id"] and call["function"]["name"] == name
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_named_and_required_tool_calls(openai_client) -> None:
    named = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_call(choice.message.tool_calls[0].model_dump(), "get_weather", WEATHER)
    required = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80,
                                                     temperature=0, tool_choice="required",
                                                     parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].model_dump()
    _check_call(call, call["function"]["name"], {"get_weather": WEATHER, "add": TOOLS[1]["function"]["parameters"]}
                [call["function"]["name"]])


def test_streamed_tool_call_arrives_in_the_final_chunk(openai_client) -> None:
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = list(stream)
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason == "tool_calls"
    _check_call(last.delta.tool_calls[0].model_dump(), "get_weather", WEATHER)


# Issue 46 item 4's shape: a property with a description, no additionalProperties. Left open, the 135M model wrote
# `"type": ..., "description": ...` into the arguments, call after call, up to max_tokens.
LOCATION = {"type": "object", "properties": {"location": {"type": "string", "description": "The city and state, "
                                                          "e.g. San Francisco, CA"}}, "required": ["location"]}


def _no_repeated_key(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


def test_required_tool_call_keeps_to_the_schema_and_stops(openai_client) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": LOCATION,
                                               "description": "Get the current weather in a given location"}}]
    completion = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=120,
                                                       temperature=0, tool_choice="required")
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice  # "stop", not "length"
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments, object_pairs_hook=_no_repeated_key)
        assert call.function.name == "get_weather" and set(arguments) == {"location"}, arguments


class Item(BaseModel):
    name: str
    price: int
    in_stock: bool


def test_openai_sdk_parse_with_a_pydantic_model(openai_client) -> None:
    completion = openai_client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a red lamp for a shop catalog."}],
        response_format=Item, max_tokens=60, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Item), completion.choices[0].message.content


def test_logit_bias_bans_and_forces_over_http(http, gguf_path) -> None:
    tokenizer = tokenizer_from_gguf(open_gguf(gguf_path), gguf_path)
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0,
            "ignore_eos": True}

    def first_token(**fields) -> int:
        text = http.post("/v1/completions", json={**body, **fields}).json()["choices"][0]["text"]
        return tokenizer.encode(text, add_special_tokens=False)[0]

    greedy = first_token()
    assert first_token(logit_bias={str(greedy): -100}) != greedy
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert first_token(logit_bias={str(forced): 100}) == forced


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", ""),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "set tools"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"guided_regex": "((", "max_tokens": 4}, "guided_regex", "does not compile"),
    ({"guided_json": ITEM, "response_format": {"type": "json_object"}}, "guided_json", "only one"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "structured_outputs", "ignore_eos"),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD)
def test_bad_constraints_are_400_naming_the_field(http, fields: dict, param: str, words: str) -> None:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and words in error["message"], error
