"""Tools and tool messages reach the model: assistant `tool_calls` and `tool` results are accepted and passed to
the chat template in transformers' shape (arguments as a dict), `tools` reach it as `tools`, and whatever the
template would drop (the embedded SmolLM2 template renders no tools and no calls) is written into the messages
instead: a tools section in the system prompt, calls as `<tool_call>` text, results as a user message."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvpilot.fit.gguf_metadata import open_gguf
from kvpilot.model.tokenizer import tokenizer_from_gguf
from kvpilot.server.prompt_tokens import render_chat
from kvpilot.server.openai.protocol import ChatCompletionRequest
from kvpilot.server.openai.tool_prompt import ToolSupport, tool_support
from tests.server.conftest import MODEL

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, sunny"}]

# A template of the Hermes kind that renders tools, calls and results itself (written for this test).
TOOL_AWARE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# One that knows no tools and refuses roles other than system / user / assistant.
STRICT_ROLES = (
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return tokenizer_from_gguf(open_gguf(gguf_path), gguf_path)


def _prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    body = ChatCompletionRequest(messages=messages, tools=tools)
    return render_chat(tokenizer, body.conversation(), True, body.template_tools())


def test_messages_reach_the_template_in_transformers_shape() -> None:
    body = ChatCompletionRequest(messages=CONVERSATION, tools=TOOLS)
    _, assistant, tool = body.conversation()
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert tool == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1", "name": "get_weather"}
    assert body.template_tools() == TOOLS
    odd = {**CALL, "function": {"name": "get_weather", "arguments": "not json"}}  # kept as the string sent
    body = ChatCompletionRequest(messages=[CONVERSATION[0], {"role": "assistant", "tool_calls": [odd]}])
    assert body.conversation()[1]["tool_calls"][0]["function"]["arguments"] == "not json"


def test_embedded_template_gets_a_tools_section_and_calls_as_text(tokenizer) -> None:
    assert tool_support(tokenizer) == ToolSupport(tools=False, tool_calls=False, tool_results=True)
    prompt = _prompt(tokenizer, CONVERSATION, TOOLS)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")  # instead of the template's default system prompt
    assert json.dumps(TOOLS[0]) in prompt and "<tool_call>" in prompt
    assert ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '</tool_call><|im_end|>') in prompt
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in prompt  # this template renders any role as given
    with_system = _prompt(tokenizer, [{"role": "system", "content": "Be brief."}, *CONVERSATION], TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    plain = [{"role": "user", "content": "hi"}]  # no tools: exactly what the template alone renders
    assert _prompt(tokenizer, plain) == tokenizer.apply_chat_template(plain, True)


def test_tool_aware_template_renders_them_itself(tokenizer) -> None:
    aware = dataclasses.replace(tokenizer, chat_template=TOOL_AWARE)
    support = tool_support(aware)
    assert support.tools and support.tool_calls and support.tool_results
    prompt = _prompt(aware, CONVERSATION, TOOLS)
    assert prompt.startswith("<|im_start|>system\nTOOLS:") and "# Tools" not in prompt
    assert json.dumps(TOOLS[0]) in prompt
    # arguments reached the template as a dict: tojson writes an object, not a quoted string
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<tool_response>18 C, sunny</tool_response>" in prompt


def test_tool_results_become_a_user_message_where_the_template_has_no_tool_role(tokenizer) -> None:
    strict = dataclasses.replace(tokenizer, chat_template=STRICT_ROLES)
    assert tool_support(strict).tool_results is False
    second = {"role": "tool", "tool_call_id": "call_2", "content": "21 C, cloudy"}
    prompt = _prompt(strict, [*CONVERSATION, second], TOOLS)
    assert ("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
            "<tool_response>\n21 C, cloudy\n</tool_response><|im_end|>") in prompt


@pytest.mark.slow
def test_tokenize_shows_the_call_the_result_and_the_tools(http, tokenizer) -> None:
    reply = http.post("/tokenize", json={"model": MODEL, "messages": CONVERSATION, "tools": TOOLS})
    assert reply.status_code == 200, reply.text
    text = tokenizer.decode(reply.json()["tokens"], skip_special_tokens=False)
    assert text == _prompt(tokenizer, CONVERSATION, TOOLS)
    assert "18 C, sunny" in text and '"arguments": {"city": "Paris"}' in text and "get_weather" in text
    # a chat completion runs on exactly those tokens (tool_choice "none": tools rendered, nothing forced)
    answer = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CONVERSATION, "tools": TOOLS,
                                                     "tool_choice": "none", "max_tokens": 2, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == reply.json()["count"]
    assert "tool_calls" not in answer.json()["choices"][0]["message"]
    with_prompt = http.post("/tokenize", json={"prompt": "hi", "tools": TOOLS})
    assert with_prompt.status_code == 400 and with_prompt.json()["error"]["param"] == "tools"


@pytest.mark.slow
@pytest.mark.parametrize(("message", "words"), [
    ({"role": "user", "content": "hi", "tool_calls": [CALL]}, "tool_calls belong on an assistant message"),
    ({"role": "assistant", "content": "hi", "tool_call_id": "call_1"}, "tool_call_id belongs on a 'tool' message"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}, "name"),
])
def test_misplaced_tool_fields_are_400s_naming_the_message(http, message: dict, words: str) -> None:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                       "messages": [CONVERSATION[0], message]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("messages.1") and words in error["message"], error
