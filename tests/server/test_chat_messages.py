"""Chat content parts: text parts reach the template joined; a part the model cannot read is refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpilot.server.chat_messages import ChatMessage


def test_text_parts_are_joined_in_order() -> None:
    message = ChatMessage(role="user", content=[{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}])
    assert message.template_message() == {"role": "user", "content": "Hello, world"}


def test_an_echoed_refusal_part_is_the_assistant_turn_s_text() -> None:
    message = ChatMessage(role="assistant", content=[{"type": "refusal", "refusal": "I can't help with that."}])
    assert message.text() == "I can't help with that."


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "f"}}, {"text": "no type"}])
def test_a_part_that_is_not_text_is_refused_by_name(part: dict) -> None:
    with pytest.raises(ValidationError, match=f"content part 1 has type {part.get('type')!r}: .*text only"):
        ChatMessage(role="user", content=[{"type": "text", "text": "What is this?"}, part])
