"""`--tool-call-parser hermes` on strings: calls read out of `<tool_call>` blocks, the text around them kept as
content, malformed blocks kept as text; and how ToolCallPlan("auto") shapes a chat choice and a last chunk."""

from __future__ import annotations

import json

from kvpilot.server.openai.hermes_tool_parser import ExtractedToolCalls, ParsedCall, extract_tool_calls
from kvpilot.server.openai.tool_calls import EMPTY_PARAMETERS, ToolCallPlan

NAMES = {"get_weather", "add"}


def test_several_calls_and_the_text_around_them() -> None:
    text = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\nDone.')
    found = extract_tool_calls(text, NAMES)
    assert found.calls == (ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("add", '{"a": 1, "b": 2}'))
    assert found.content == "Let me look that up.\n\n\nDone."


def test_text_without_blocks_is_all_content() -> None:
    found = extract_tool_calls("  Paris is sunny today.  ", NAMES)
    assert found.calls == () and found.content == "Paris is sunny today."
    assert extract_tool_calls("", NAMES).content == ""


def test_malformed_blocks_stay_as_text() -> None:
    bad_json = '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
    assert extract_tool_calls(bad_json, NAMES).calls == ()
    assert extract_tool_calls(bad_json, NAMES).content == bad_json
    for body in ('["add"]', '{"arguments": {}}', '{"name": "add", "arguments": [1]}', '{"name": "nope"}'):
        text = f"<tool_call>{body}</tool_call>"
        assert extract_tool_calls(text, NAMES) == ExtractedToolCalls((), text), body
    # a good call after a bad one is still read; the bad one stays where it was
    mixed = 'A <tool_call>{oops}</tool_call> B <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    found = extract_tool_calls(mixed, NAMES)
    assert found.calls == (ParsedCall("add", '{"a": 2, "b": 3}'),)
    assert found.content == "A <tool_call>{oops}</tool_call> B"


def test_unclosed_blocks() -> None:
    # The last block may lack its closing tag when its JSON is complete (a model that stops right after it)...
    found = extract_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}', NAMES)
    assert found.calls == (ParsedCall("add", '{"a": 1, "b": 1}'),) and found.content == ""
    # ...but one cut short (max_tokens) is text, and so is a block never closed before the next one opens.
    cut = '<tool_call>{"name": "add", "arguments": {"a": 1'
    assert extract_tool_calls(cut, NAMES).calls == () and extract_tool_calls(cut, NAMES).content == cut
    found = extract_tool_calls('<tool_call>{"na <tool_call>{"name": "add"}</tool_call>', NAMES)
    assert found.calls == (ParsedCall("add", "{}"),) and found.content == '<tool_call>{"na'


def test_arguments_shapes() -> None:
    as_string = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>'
    assert extract_tool_calls(as_string, NAMES).calls == (ParsedCall("add", '{"a": 5}'),)
    synonym = '<tool_call>{"name": "add", "parameters": {"a": 6}}</tool_call>'
    assert extract_tool_calls(synonym, NAMES).calls == (ParsedCall("add", '{"a": 6}'),)
    unicode = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
    assert extract_tool_calls(unicode, NAMES).calls[0].arguments == '{"city": "Zürich"}'
    assert extract_tool_calls('<tool_call>{"name": "anything"}</tool_call>').calls == (ParsedCall("anything", "{}"),)


PLAN = ToolCallPlan({"get_weather": EMPTY_PARAMETERS, "add": EMPTY_PARAMETERS}, parser="hermes")
CALL_TEXT = 'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def test_auto_plan_constrains_nothing_and_shapes_the_message() -> None:
    assert PLAN.spec() is None
    choice = {"index": 0, "logprobs": None, "finish_reason": "stop", "stop_reason": None,
              "message": {"role": "assistant", "content": CALL_TEXT}}
    shaped = PLAN.shape_message(choice, CALL_TEXT, "stop")
    assert shaped["finish_reason"] == "tool_calls" and shaped["message"]["content"] == "Checking."
    [call] = shaped["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    only_call = CALL_TEXT.removeprefix("Checking.\n")
    assert PLAN.shape_message(choice, only_call, "stop")["message"]["content"] is None
    plain = {**choice, "message": {"role": "assistant", "content": "It is sunny."}}
    assert PLAN.shape_message(plain, "It is sunny.", "stop") == plain  # an ordinary answer, untouched


def test_auto_plan_last_chunk_holds_text_and_calls() -> None:
    chunk = {"index": 0, "logprobs": None, "finish_reason": "stop", "delta": {"content": "l>"}}
    last = PLAN.final_delta(chunk, CALL_TEXT, "stop")
    assert last["finish_reason"] == "tool_calls" and last["delta"]["content"] == "Checking."
    [call] = last["delta"]["tool_calls"]
    assert call["index"] == 0 and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    plain = PLAN.final_delta({**chunk, "finish_reason": "length"}, "It is", "length")
    assert plain["delta"] == {"content": "It is"} and plain["finish_reason"] == "length"


def test_auto_plan_streams_text_until_a_call_marker_may_begin() -> None:
    assert [PLAN.streamable(CALL_TEXT[:n]) for n in (3, 10, 11, 14, 21, 22, len(CALL_TEXT))] == [
        3, 10, 10, 10, 10, 10, 10]  # "Checking.\n" streams; "<", "<tool", "<tool_call>..." are held back
    assert PLAN.streamable("a < b and <too") == len("a < b and ")  # a "<" followed by other text streams
    assert PLAN.streamable("It is sunny.") == len("It is sunny.")
    forced = ToolCallPlan({"add": EMPTY_PARAMETERS})
    assert forced.streamable('{"a": 1}') == 0  # a forced call's text is the call: all held back
    chunk = {"index": 0, "logprobs": None, "finish_reason": "stop", "delta": {}}
    last = PLAN.final_delta(chunk, CALL_TEXT, "stop", num_streamed=len("Checking.\n"))
    assert "content" not in last["delta"] and last["finish_reason"] == "tool_calls"  # sent already
    assert last["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    tail = PLAN.final_delta(chunk, "It is <to", "length", num_streamed=len("It is "))
    assert tail["delta"] == {"content": "<to"}  # the held-back end that never became a call


def test_auto_plan_keeps_one_call_when_parallel_calls_are_off() -> None:
    two = CALL_TEXT + '\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    calls, _ = PLAN.parsed(two)
    assert calls is not None and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    single = ToolCallPlan(PLAN.parameters, parallel=False, parser="hermes")
    calls, _ = single.parsed(two)
    assert calls is not None and [c["function"]["name"] for c in calls] == ["get_weather"]
