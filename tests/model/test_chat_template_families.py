"""The families' chat templates render as transformers renders them (model/chat_template.py), from where each
layout keeps them (model/tokenizer.py): small templates written here with the real ones' constructs, Gemma's
`raise_exception` on a system turn (a clear ChatTemplateError), `{% generation %}` blocks, `strftime_now`,
Qwen3's `enable_thinking` through chat_template_kwargs; the HF directory's chat_template.jinja (newer layout),
chat_template.json and tokenizer_config.json's `chat_template` (a string or a list of named templates)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer as BackendTokenizer, models, pre_tokenizers
from transformers.utils.chat_template_utils import render_jinja_template

from kvpilot.model.chat_template import ChatTemplateError, render_chat
from kvpilot.model.tokenizer import tokenizer_from_hf_dir

# Gemma 2: no system role (a raise_exception), turns between <start_of_turn> and <end_of_turn>
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
# Llama 3.1: a dated system header (strftime_now, a date_string default)
LLAMA31 = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}"
    "{%- endif %}{%- endif %}<|start_header_id|>system<|end_header_id|>\n\nToday Date: {{ date_string }}<|eot_id|>"
    "{%- for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")
# SmolLM3 / training templates: the assistant's text inside {% generation %}
GENERATION = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ message['content'] }}"
    "<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3: thinking on unless enable_thinking is false (then an empty block closes it in the prompt)
QWEN3 = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}")
CHAT = [{"role": "user", "content": "Hi "}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Capital of France?"}]
SPECIAL = {"bos_token": "<bos>", "eos_token": "<eos>"}


@pytest.mark.parametrize("template", [GEMMA, LLAMA31, GENERATION, QWEN3], ids=["gemma", "llama3.1", "generation",
                                                                               "qwen3"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["default", "no-thinking"])
def test_renders_as_transformers(template: str, kwargs: dict) -> None:
    rendered, _ = render_jinja_template([CHAT], chat_template=template, add_generation_prompt=True, **SPECIAL,
                                        **kwargs)  # (one text per conversation, generation indices)
    assert render_chat(template, CHAT, True, None, kwargs, **SPECIAL) == rendered[0]


def test_gemma_refuses_a_system_turn_with_its_own_words() -> None:
    with pytest.raises(ChatTemplateError, match="the model's chat template refuses these messages: System role "
                                                "not supported"):
        render_chat(GEMMA, [{"role": "system", "content": "Be brief."}, *CHAT])
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        render_chat(GEMMA, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_strftime_now_dates_the_prompt() -> None:
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}" in render_chat(LLAMA31, CHAT, **SPECIAL)
    fixed = render_chat(LLAMA31, CHAT, True, None, {"date_string": "01 Jan 2030"}, **SPECIAL)
    assert "Today Date: 01 Jan 2030" in fixed  # a request's variable wins


def test_enable_thinking_reaches_the_template() -> None:
    assert render_chat(QWEN3, CHAT).endswith("<|im_start|>assistant\n")
    assert render_chat(QWEN3, CHAT, True, None, {"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reserved_variables_and_broken_templates_are_clear_errors() -> None:
    with pytest.raises(ChatTemplateError, match="may not set add_generation_prompt, messages"):
        render_chat(QWEN3, CHAT, True, None, {"messages": [], "add_generation_prompt": False})
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for m in messages %}", CHAT)
    with pytest.raises(ChatTemplateError, match="failed on these messages: TypeError"):
        render_chat("{{ messages[0]['content'] + 1 }}", CHAT)


def _hf_dir(directory: Path, **files: object) -> Path:
    """A tokenizer directory: tokenizer.json (a tiny vocabulary) and the given files (name: text or JSON)."""
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "hi": 3}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<bos>", "<eos>")])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (directory / name.replace("__", ".")).write_text(text)
    return directory


def test_the_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": "OLD"}
    tokenizer = tokenizer_from_hf_dir(_hf_dir(tmp_path, tokenizer_config__json=config, chat_template__jinja=GEMMA))
    assert tokenizer.chat_template == GEMMA
    assert tokenizer.apply_chat_template(CHAT).startswith("<bos><start_of_turn>user\nHi<end_of_turn>\n")


def test_templates_from_chat_template_json_and_named_lists(tmp_path: Path) -> None:
    processor = tokenizer_from_hf_dir(_hf_dir(tmp_path / "a", chat_template__json={"chat_template": QWEN3}))
    assert processor.chat_template == QWEN3
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": LLAMA31}]
    listed = tokenizer_from_hf_dir(_hf_dir(tmp_path / "b", tokenizer_config__json={"chat_template": named}))
    assert listed.chat_template == LLAMA31
    plain = tokenizer_from_hf_dir(_hf_dir(tmp_path / "c", tokenizer_config__json={"chat_template": GENERATION}))
    assert plain.chat_template == GENERATION
    assert tokenizer_from_hf_dir(_hf_dir(tmp_path / "d")).chat_template is None
