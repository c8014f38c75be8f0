"""`--reasoning-parser qwen3` through the HTTP routes (real embedded model, its tokenizer given a Qwen3.5-style
chat template written here: the prompt opens a `<think>` block unless `chat_template_kwargs` says
`enable_thinking: false`; a system turn is refused as Gemma's template refuses it; tools rendered by the
template; `{% generation %}` and `strftime_now` in it). The model's text is made known by a structured-outputs
regex: a constrained output is read from its first token (its grammar held there), so the forced text opens
its own block. Non-streamed: message.reasoning / reasoning_content and content; streamed: reasoning deltas
first, then content; with tools: the calls read out of the answer only."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator

import httpx
import pytest

from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from kvpilot.server.openai.chat_output import chat_output_for
from kvpilot.server.openai.protocol import ChatCompletionRequest
from kvpilot.server.openai.reasoning_parser import Phase
from kvpilot.server.prompt_tokens import tokenize_request
from tests.server.chat_requests import chat_choice, streamed_choices
from tests.server.conftest import API_KEY, MODEL, authed_http, openai_sdk, server_engine_args

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
    "{%- if tools %}{{ '<|im_start|>system\\nDate: ' + strftime_now('%Y-%m-%d') + '. Call a tool as "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>. Tools:\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson + '\\n' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}{% generation %}{{ message.content + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{ message.content + '<|im_end|>' }}{%- endif %}{{ '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}")
ASK = [{"role": "user", "content": "What is the capital of France?"}]
THOUGHT = "<think>\nThe user asks for the capital.\n</think>\n\nParis."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": CITY}}]


def _forced(text: str) -> dict:
    """The request fields that make the model write exactly `text`."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def _templated(loaded):
    return dataclasses.replace(loaded, tokenizer=dataclasses.replace(loaded.tokenizer, chat_template=TEMPLATE))


@pytest.fixture(scope="module")
def reasoning_server(llm_fp32) -> Iterator[BackgroundServer]:
    args = ServerArgs(served_model_names=(MODEL,), api_key=API_KEY, engine_process=False, reasoning_parser="qwen3",
                      enable_auto_tool_choice=True, tool_call_parser="hermes")
    factory = engine_factory(server_engine_args(), _templated(llm_fp32.loaded), warmup=False)
    with BackgroundServer(create_app(factory, args)) as server:
        yield server


@pytest.fixture()
def client(reasoning_server: BackgroundServer) -> Iterator[httpx.Client]:
    with authed_http(reasoning_server) as http:
        yield http


def _chat(client: httpx.Client, **fields) -> dict:
    return chat_choice(client, {"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0, **fields})


def _stream(client: httpx.Client, **fields) -> list[dict]:
    return streamed_choices(client, {"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0, **fields})


def test_reasoning_is_split_off_the_answer(client: httpx.Client) -> None:
    choice = _chat(client, **_forced(THOUGHT))
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == "The user asks for the capital."
    assert message["content"] == "Paris." and choice["finish_reason"] == "stop"


def test_the_openai_sdk_reads_reasoning_content(reasoning_server: BackgroundServer) -> None:
    with openai_sdk(reasoning_server) as sdk:
        answer = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                             extra_body=_forced(THOUGHT))
    assert answer.choices[0].message.content == "Paris."
    assert answer.choices[0].message.reasoning_content == "The user asks for the capital."  # an extra field


def test_streamed_reasoning_deltas_then_content(client: httpx.Client) -> None:
    deltas = [c["delta"] for c in _stream(client, **_forced(THOUGHT))]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    assert "".join(reasoning) == "The user asks for the capital." and len(reasoning) > 1  # token by token
    assert "".join(d.get("reasoning", "") for d in deltas) == "".join(reasoning)
    assert "".join(d.get("content") or "" for d in deltas) == "Paris."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any("reasoning_content" in d for d in deltas[first_content:])
    assert not any("<think>" in (d.get("content") or "") + d.get("reasoning", "") for d in deltas)


def test_enable_thinking_false_reaches_the_template(client: httpx.Client) -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    tokenized = client.post("/tokenize", json={"model": MODEL, "messages": ASK, **kwargs})
    prompt = client.post("/detokenize", json={"model": MODEL, "tokens": tokenized.json()["tokens"]}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the prompt closed the block, so nothing the model writes is reasoning
    message = _chat(client, **kwargs, **_forced(THOUGHT))["message"]
    assert message["content"] == THOUGHT and message["reasoning_content"] is None


def test_reserved_template_variables_are_a_400(client: httpx.Client) -> None:
    body = {"model": MODEL, "messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"


def test_a_system_turn_the_template_refuses_is_a_400(client: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, *ASK]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "System role not supported" in error["message"]


def test_tool_calls_after_reasoning(client: httpx.Client) -> None:
    text = f"<think>\nI need the weather.\n</think>\n\n{CALL}"
    choice = _chat(client, tools=TOOLS, **_forced(text))
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "I need the weather." and message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    streamed = _stream(client, tools=TOOLS, **_forced(text))
    assert "".join(c["delta"].get("reasoning_content", "") for c in streamed) == "I need the weather."
    assert streamed[-1]["finish_reason"] == "tool_calls"
    assert streamed[-1]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert not any("<tool" in (c["delta"].get("content") or "") for c in streamed)


def test_the_prompt_that_opens_the_block_starts_the_output_in_it(llm_fp32) -> None:
    """The plumbing a free (unconstrained) output relies on: the rendered prompt's end reaches the plan."""
    tokenizer = _templated(llm_fp32.loaded).tokenizer
    for kwargs, phase in (({}, Phase.REASONING), ({"enable_thinking": False}, Phase.CONTENT)):
        body = ChatCompletionRequest(model=MODEL, messages=ASK, chat_template_kwargs=kwargs)
        prompt = tokenize_request(body, tokenizer, tokenizer.vocab_size, 1024)
        plan = chat_output_for(body, "qwen3", prompt.chat_tail)
        assert plan is not None and plan.reasoning is not None and plan.reasoning.phase is phase
    assert chat_output_for(body, None, prompt.chat_tail) is None  # no parser, no tools: the text is the content
