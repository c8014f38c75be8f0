"""Chat messages: text parts reach the template joined; a part the model cannot read is refused; each role's
rule (OpenAI's) is a 400 naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpilot.server.openai.chat_messages import ROLE_RULES, ChatMessage, check_roles
from kvpilot.server.openai.errors import APIError


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


@pytest.mark.parametrize(("message", "param", "words"), [
    ({"role": "tool"}, "messages.1.content", "a 'tool' message needs content"),
    ({"role": "tool", "content": "18 C"}, "messages.1.tool_call_id", "needs tool_call_id (the id of the assistant's"),
    ({"role": "user", "content": None}, "messages.1.content", "a 'user' message needs content"),
    ({"role": "developer"}, "messages.1.content", "a 'developer' message needs content"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages.1.content", "content or tool_calls"),
    ({"role": "system", "content": "x", "tool_calls": []}, "messages.1.tool_calls", "belong on an assistant message"),
    ({"role": "assistant", "content": "x", "tool_call_id": "c"}, "messages.1.tool_call_id", "belongs on a 'tool'"),
])
def test_each_role_s_rule_is_a_400_naming_the_field(message: dict, param: str, words: str) -> None:
    """OpenAI's per-role rules (issue 43: `{"role": "tool"}` alone and a null user content reached the model as
    empty turns and generated up to max_tokens)."""
    messages = [ChatMessage(role="user", content="Hi"), ChatMessage(**message)]
    with pytest.raises(APIError) as raised:
        check_roles(messages)
    assert raised.value.status == 400 and raised.value.param == param and words in raised.value.message


def test_every_role_s_complete_message_passes() -> None:
    call = {"id": "call_1", "function": {"name": "f", "arguments": "{}"}}
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="developer", content=""),
                ChatMessage(role="user", content=[{"type": "text", "text": "Hi"}]),
                ChatMessage(role="assistant", tool_calls=[call]),
                ChatMessage(role="tool", content="18 C", tool_call_id="call_1"),
                ChatMessage(role="assistant", content="It is 18 C.")]
    assert check_roles(messages) is messages
    assert set(ROLE_RULES) == set(ChatMessage.model_fields["role"].annotation.__args__)  # one rule per role
