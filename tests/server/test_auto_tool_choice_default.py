"""Issue 46 item 4: tool_choice "auto" without flags follows the model's chat template (auto_tool_choice.py). The
embedded SmolLM2 template renders no tools (kvpilot lists them as Hermes instructions): on, hermes; a template
that renders tools and asks for <tool_call> blocks: on, hermes; one that renders tools in another format: off;
the flags override the template either way, and the start-up line says what was decided and why."""

from __future__ import annotations

import dataclasses

import pytest

from kvpilot.fit.gguf_metadata import open_gguf
from kvpilot.model.tokenizer import tokenizer_from_gguf
from kvpilot.server.openai.auto_tool_choice import decide_auto_tool_choice

# Written for this test: a Qwen-like template that lists the tools and asks for <tool_call> blocks, and a
# Llama-3-like one that lists them but asks for a bare JSON object (a format no kvpilot parser reads).
HERMES_LIKE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
               "Call a function as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
               "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
JSON_LIKE = ("{% if tools %}<|start_header_id|>system<|end_header_id|>\n{% for t in tools %}{{ t | tojson }}\n"
             "{% endfor %}Respond with {\"name\": function name, \"parameters\": arguments}.<|eot_id|>{% endif %}"
             "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n{{ m.content }}<|eot_id|>"
             "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return tokenizer_from_gguf(open_gguf(gguf_path), gguf_path)


def test_the_embedded_template_gets_hermes_by_default(tokenizer) -> None:
    decided = decide_auto_tool_choice(None, None, tokenizer)
    assert decided.parser == "hermes"
    assert decided.log_line().startswith('tool_choice "auto" is on (tool calls read by the hermes parser)')
    assert "renders no tools" in decided.log_line() and "--no-enable-auto-tool-choice" in decided.log_line()


def test_a_template_is_read_for_its_call_format(tokenizer) -> None:
    hermes = decide_auto_tool_choice(None, None, dataclasses.replace(tokenizer, chat_template=HERMES_LIKE))
    assert hermes.parser == "hermes" and "<tool_call>" in hermes.reason
    other = decide_auto_tool_choice(None, None, dataclasses.replace(tokenizer, chat_template=JSON_LIKE))
    assert other.parser is None and other.log_line().startswith('tool_choice "auto" is off')
    assert "--enable-auto-tool-choice --tool-call-parser" in other.reason
    assert decide_auto_tool_choice(None, None, dataclasses.replace(tokenizer, chat_template=None)).parser is None
    assert decide_auto_tool_choice(None, None, None).parser is None  # a model without a tokenizer


def test_the_flags_override_the_template(tokenizer) -> None:
    json_like = dataclasses.replace(tokenizer, chat_template=JSON_LIKE)
    assert decide_auto_tool_choice(True, "hermes", json_like).parser == "hermes"
    assert decide_auto_tool_choice(None, "hermes", json_like).parser == "hermes"  # the parser alone turns it on
    off = decide_auto_tool_choice(False, None, tokenizer)
    assert off.parser is None and off.reason == "--no-enable-auto-tool-choice"
    assert decide_auto_tool_choice(False, "hermes", tokenizer).parser is None
