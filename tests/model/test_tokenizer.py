"""kvpilot's tokenizer and chat template (built from GGUF metadata) agree with transformers'."""

from __future__ import annotations

import pytest

from kvpilot.model.chat_template import ChatTemplateError
from kvpilot.fit.gguf_metadata import open_gguf
from kvpilot.model.tokenizer import tokenizer_from_gguf

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "Und auf Deutsch? Grüße, 日本語 😀"}],
]
TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnewlines", "12345 digits 3.14", "ünïcødé 日本語 😀",
         "<|im_start|>user special tokens<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return tokenizer_from_gguf(open_gguf(gguf_path), gguf_path)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_ids_match_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert tokenizer.encode_chat(messages, add_generation_prompt) == list(expected)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)


def test_bad_messages_are_clear(tokenizer):
    with pytest.raises(ChatTemplateError, match=r"messages\[0\] must be a dict with 'role' and 'content'"):
        tokenizer.encode_chat([{"text": "hi"}])
