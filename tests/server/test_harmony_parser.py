"""gpt-oss's harmony format on known text: `--reasoning-parser openai_gptoss` (the analysis channel is the
reasoning, the final channel and preambles the answer) and `--tool-call-parser openai` (messages to
`functions.NAME` become tool calls, in every header variant the format allows), whole and streamed in
pieces of any size (the pieces add up to the whole reading, and no marker reaches the user)."""

from __future__ import annotations

import json
import random

import pytest

from kvpilot.server.config import ServerArgs, ServerConfigError
from kvpilot.server.openai.chat_output import ChatOutput
from kvpilot.server.openai.harmony_parser import (MARKERS, HarmonyPlan, harmony_start_note, has_harmony_markers)
from kvpilot.server.openai.harmony_tool_parser import extract_tool_calls
from kvpilot.server.openai.tool_calls import EMPTY_PARAMETERS, ToolCallPlan

TAIL = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"  # gpt-oss's template ends so
ANALYSIS = "<|channel|>analysis<|message|>The user asks for the weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."
ARGS = '{"city": "Paris"}'
# the call's header variants: recipient after the channel (with or without <|constrain|>), or after the role
CALLS = (f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}",
         f"<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{ARGS}",
         f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>",
         f"<|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>{ARGS}")
TOOLS = ToolCallPlan({"get_weather": EMPTY_PARAMETERS}, parser="openai")


def _read(text: str, tail: str = TAIL, tool_calls: bool = False) -> tuple[str, str]:
    return HarmonyPlan.for_prompt(tail, tool_calls=tool_calls).split(text)


def test_analysis_is_reasoning_and_final_is_the_answer() -> None:
    assert _read(ANALYSIS + FINAL) == ("The user asks for the weather.", "It is sunny.")
    assert _read("<|channel|>analysis<|message|>Still thinking") == ("Still thinking", "")  # cut by max_tokens
    assert _read(ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>" + FINAL) == (
        "The user asks for the weather.\nMore.", "It is sunny.")  # messages of one kind: one per line
    # a preamble (commentary without a recipient) is answer; a built-in tool's call is the model's own thinking
    assert _read("<|channel|>commentary<|message|>Let me look.<|end|>" + FINAL) == ("", "Let me look.\nIt is sunny.")
    assert _read('<|channel|>analysis to=browser.search<|message|>{"q": "x"}<|end|>' + FINAL) == (
        '{"q": "x"}', "It is sunny.")


def test_output_that_is_not_harmony_is_the_answer_as_written() -> None:
    assert _read(' {"a": 1}') == ("", ' {"a": 1}')  # e.g. a constrained request's JSON
    assert _read("Paris.", tail="") == ("", "Paris.")
    # a prompt that ends inside a final message's body: the output continues it
    assert _read("sunny.", tail="<|start|>assistant<|channel|>final<|message|>") == ("", "sunny.")


@pytest.mark.parametrize("call", CALLS)
def test_tool_calls_in_every_header_variant(call: str) -> None:
    reasoning, answer = _read(ANALYSIS + call, tool_calls=True)
    assert reasoning == "The user asks for the weather."
    found = extract_tool_calls(answer, {"get_weather"})
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [("get_weather", {"city": "Paris"})]
    assert found.content == ""
    # the first message's recipient may follow the prompt's `<|start|>assistant` directly
    first = call.removeprefix("<|start|>assistant")
    assert extract_tool_calls(_read(first, tool_calls=True)[1]).calls == found.calls


def test_calls_the_request_did_not_offer_stay_text_without_markers() -> None:
    text = "<|channel|>commentary to=functions.launch<|message|>{}<|end|>" + FINAL
    found = extract_tool_calls(_read(text, tool_calls=True)[1], {"get_weather"})
    assert found.calls == () and found.content == "{}\nIt is sunny."
    # without a tool parser a call's body is answer text
    assert _read(CALLS[0].removeprefix("<|start|>assistant"))[1] == ARGS


@pytest.mark.parametrize("text", [ANALYSIS + FINAL, ANALYSIS + CALLS[0], "<|channel|>commentary<|message|>Hi"
                                  "<|end|>" + CALLS[2] + CALLS[3], ' {"a": 1}', "<|channel|>analysis<|mess"])
def test_streamed_pieces_add_up_to_the_whole_reading(text: str) -> None:
    plan = HarmonyPlan.for_prompt(TAIL, tool_calls=True)
    whole = plan.split(text)
    rng = random.Random(0)
    for _ in range(20):
        scanner, reasoning, answer, end = plan.scanner(), "", "", 0
        while end < len(text):
            end = min(len(text), end + rng.randint(1, 6))
            piece = scanner.feed(text[:end])
            reasoning, answer = reasoning + piece.reasoning, answer + piece.content
        piece = scanner.feed(text, final=True)
        assert (reasoning + piece.reasoning, answer + piece.content) == whole
    assert not any(marker in whole[0] for marker in MARKERS)


def _stream(output: ChatOutput, text: str, step: int = 2) -> tuple[list[dict], dict]:
    stream, deltas = output.stream(), []
    for end in range(step, len(text), step):
        delta = stream.running(text[:end])
        if delta is not None:
            deltas.append(delta)
    chunk = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    return deltas, stream.final(chunk, text, "stop")


def test_chat_message_and_stream_shapes() -> None:
    output = ChatOutput(TOOLS, HarmonyPlan.for_prompt(TAIL, tool_calls=True))
    choice = {"index": 0, "message": {"role": "assistant", "content": "raw"}, "finish_reason": "stop"}
    text = ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALLS[2]
    shaped = output.shape_message(choice, text + FINAL, "stop")  # text on both sides of a call: one per line
    assert shaped["message"]["content"] == "Checking.\nIt is sunny."
    shaped = output.shape_message(choice, text, "stop")
    message = shaped["message"]
    assert shaped["finish_reason"] == "tool_calls" and message["reasoning_content"] == "The user asks for the weather."
    assert message["content"] == "Checking." and message["tool_calls"][0]["function"]["name"] == "get_weather"
    deltas, last = _stream(output, text)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user asks for the weather."
    streamed = "".join(d.get("content", "") for d in [*deltas, last["delta"]])
    assert streamed == "Checking." and not any(m in streamed for m in MARKERS)
    assert last["finish_reason"] == "tool_calls"
    assert json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_flags_and_the_start_up_note() -> None:
    assert ServerArgs(reasoning_parser="openai_gptoss").reasoning_parser == "openai_gptoss"
    ServerArgs(enable_auto_tool_choice=True, tool_call_parser="openai")  # the harmony reading comes with it
    with pytest.raises(ServerConfigError, match="--tool-call-parser openai reads gpt-oss's harmony messages"):
        ServerArgs(enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser="qwen3")
    note = harmony_start_note(None, None)
    assert note is not None and "--reasoning-parser openai_gptoss" in note and "--tool-call-parser openai" in note
    assert harmony_start_note("openai_gptoss", "openai") is None
    assert not has_harmony_markers(None)


# gpt-oss's template, cut to what the tool probe reads: tools listed as a `functions` namespace, past calls
# written back in harmony form, tool results as messages from the function
GPT_OSS_TEMPLATE = (
    "{%- if tools %}{{ '<|start|>developer<|message|># Tools\\nnamespace functions {' }}{%- for tool in tools %}"
    "{{ 'type ' + tool.function.name + ' = () => any;' }}{%- endfor %}{{ '}<|end|>' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}{%- for c in m.tool_calls %}"
    "{{ '<|start|>assistant to=' }}{{ 'functions.' + c.function.name + '<|channel|>commentary json<|message|>' }}"
    "{{ c.function.arguments | tojson + '<|call|>' }}{%- endfor %}"
    "{%- elif m.role == 'tool' %}{{ '<|start|>functions.' + (m.name or 'tool') + ' to=assistant<|channel|>"
    "commentary<|message|>' + m.content + '<|end|>' }}"
    "{%- else %}{{ '<|start|>' + m.role + '<|message|>' + (m.content or '') + '<|end|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{%- endif %}")


def test_gpt_oss_template_turns_auto_tool_choice_on_with_the_openai_parser() -> None:
    from tokenizers import Tokenizer as BackendTokenizer, models

    from kvpilot.model.tokenizer import Tokenizer
    from kvpilot.server.openai.auto_tool_choice import decide_auto_tool_choice

    tokenizer = Tokenizer(BackendTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                          chat_template=GPT_OSS_TEMPLATE)
    assert decide_auto_tool_choice(None, None, tokenizer).parser == "openai"
