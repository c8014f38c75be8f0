"""tool_choice "auto" on a server started without tool flags (real embedded model: its template renders no tools,
so "auto" is on by default with the hermes parser, auto_tool_choice.py): the output is free, and `<tool_call>`
blocks in it become `message.tool_calls` (streamed: text before a call's marker as content, the calls in the
last chunk); an answer without them is ordinary content; "none" parses nothing. The OpenAI SDK round-trips a
whole tool conversation: forced call -> tool result -> the next answer. The flags are checked at start-up;
--no-enable-auto-tool-choice turns "auto" off (a 400 naming the flags).

The 135M model calls a tool by itself after a few turns of history that show it how (the history's calls are
written into the prompt as `<tool_call>` text by tool_prompt.py, its template having no tool syntax)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from kvpilot.server.config import ServerConfigError
from tests.server.conftest import API_KEY, MODEL, authed_http, openai_sdk, server_engine_args

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]


def _history() -> list[dict]:
    """Three earlier turns, each: question, call, result, answer (OpenAI's message shapes)."""
    messages: list[dict] = []
    for i, (city, weather) in enumerate([("London", "12 C, rain"), ("Tokyo", "25 C, clear"),
                                         ("Berlin", "15 C, windy")]):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        messages += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": weather},
                     {"role": "assistant", "content": f"It is {weather} in {city}."}]
    return messages


ASK_PARIS = [*_history(), {"role": "user", "content": "What is the weather in Paris?"}]
ASK_SUM = [*_history(), {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def auto_server(llm_fp32) -> Iterator[BackgroundServer]:
    """The engine core in a thread on the session's float32 weights (the same GGUF, no second load)."""
    args = ServerArgs(served_model_names=(MODEL,), api_key=API_KEY, engine_process=False)  # no tool flags
    factory = engine_factory(server_engine_args(), llm_fp32.loaded, warmup=False)
    with BackgroundServer(create_app(factory, args)) as server:
        yield server


@pytest.fixture(scope="module")
def off_server(llm_fp32) -> Iterator[BackgroundServer]:
    args = ServerArgs(served_model_names=(MODEL,), api_key=API_KEY, engine_process=False,
                      enable_auto_tool_choice=False)
    factory = engine_factory(server_engine_args(), llm_fp32.loaded, warmup=False)
    with BackgroundServer(create_app(factory, args)) as server:
        yield server


@pytest.fixture()
def client(auto_server: BackgroundServer) -> Iterator[httpx.Client]:
    with authed_http(auto_server) as http:
        yield http


@pytest.fixture()
def sdk(auto_server: BackgroundServer):
    with openai_sdk(auto_server) as sdk:
        yield sdk


def _chat(client: httpx.Client, messages: list[dict], **fields) -> dict:
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 40, "temperature": 0, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_auto_reads_the_call_out_of_the_text(client: httpx.Client) -> None:
    choice = _chat(client, ASK_PARIS, tool_choice="auto")
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"] and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_auto_without_a_call_is_an_ordinary_answer(client: httpx.Client) -> None:
    choice = _chat(client, ASK_SUM, tool_choice="auto")
    assert choice["finish_reason"] in ("stop", "length") and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] and "<tool_call>" not in choice["message"]["content"]


def test_none_renders_the_tools_but_parses_nothing(client: httpx.Client) -> None:
    choice = _chat(client, ASK_PARIS, tool_choice="none")
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert choice["message"]["content"].startswith("<tool_call>")  # the model's text, as it wrote it


def test_auto_streamed_sends_text_and_calls_in_the_last_chunk(sdk) -> None:
    # no tool_choice: "auto" is the default when tools are given
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK_PARIS, tools=TOOLS, max_tokens=40,
                                              temperature=0, stream=True))
    *before, last = [c.choices[0] for c in chunks if c.choices]
    assert not any(c.delta.tool_calls for c in before) and "<tool" not in "".join(
        c.delta.content or "" for c in before)  # text streams, a call's marker never does
    assert last.finish_reason == "tool_calls" and last.delta.tool_calls[0].function.name == "get_weather"
    assert json.loads(last.delta.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_auto_streams_an_answer_without_calls_as_it_is_written(sdk) -> None:
    """Text that holds no call marker is not held back: it arrives in several chunks, as without tools (held back,
    it would come in one at the end). Not "many": the answer can be "It is 4.", and a server behind its stream
    sends the tokens it has in one chunk."""
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK_SUM, tools=TOOLS, max_tokens=24,
                                              temperature=0, stream=True))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    whole = sdk.chat.completions.create(model=MODEL, messages=ASK_SUM, tools=TOOLS, max_tokens=24, temperature=0)
    assert len(contents) >= 2 and "".join(contents) == whole.choices[0].message.content


def test_openai_sdk_round_trips_a_tool_conversation(sdk) -> None:
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = forced.choices[0].message.tool_calls[0]
    messages.append(forced.choices[0].message)  # the SDK's own message object, sent back as it is
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
    answer = sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.role == "assistant" and (choice.message.content or choice.message.tool_calls)
    for made in choice.message.tool_calls or []:
        assert made.function.name == "get_weather" and isinstance(json.loads(made.function.arguments), dict)


def test_no_enable_auto_tool_choice_makes_auto_a_400_naming_the_flags(off_server: BackgroundServer) -> None:
    with authed_http(off_server) as http:
        for fields in ({}, {"tool_choice": "auto"}):
            body = {"model": MODEL, "messages": ASK_PARIS, "tools": TOOLS, "max_tokens": 4, **fields}
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "tool_choice" and "--no-enable-auto-tool-choice" in error["message"]
            assert "--enable-auto-tool-choice --tool-call-parser" in error["message"]
        forced = {"model": MODEL, "messages": ASK_PARIS, "tools": TOOLS, "max_tokens": 60, "temperature": 0,
                  "tool_choice": "required", "parallel_tool_calls": False}  # forced calls need no parser
        choice = http.post("/v1/chat/completions", json=forced).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice


def test_the_flags_are_checked_at_start_up() -> None:
    with pytest.raises(ServerConfigError, match="--tool-call-parser 'pythonic' is not one kvpilot has"):
        ServerArgs(enable_auto_tool_choice=True, tool_call_parser="pythonic")
    result = subprocess.run([sys.executable, "-m", "kvpilot.cli", "serve", "--enable-auto-tool-choice"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser too" in result.stderr
