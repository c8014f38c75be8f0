"""--reasoning-parser on known model text: the `<think>` block split off the answer (qwen3, deepseek_r1), where
the block starts read from the prompt's end (Qwen3.5's template opens it, `enable_thinking: false` closes it),
streamed pieces that add up to the whole split however the text arrives, and the split combined with tool
calls read out of the answer (message and stream shapes)."""

from __future__ import annotations

import json
import random

import pytest

from kvpilot.server.config import ServerArgs, ServerConfigError
from kvpilot.server.openai.chat_output import ChatOutput
from kvpilot.server.openai.reasoning_parser import REASONING_PARSERS, Phase, ReasoningPlan, ReasoningScanner
from kvpilot.server.openai.tool_calls import EMPTY_PARAMETERS, ToolCallPlan

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
ASSISTANT = "<|im_start|>assistant\n"  # a template that leaves the block to the model (Qwen3)
OPENED = "<|im_start|>assistant\n<think>\n"  # Qwen3.5 / thinking-2507: the prompt opens the block
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking false
THOUGHT = "<think>\nThe user asks for the capital.\nIt is Paris.\n</think>\n\nParis."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = ToolCallPlan({"get_weather": EMPTY_PARAMETERS}, parser="hermes")


def _split(syntax, tail: str, text: str, **plan) -> tuple[str, str]:
    return ReasoningPlan.for_prompt(syntax, tail, **plan).split(text)


def test_qwen3_splits_the_block_off_the_answer() -> None:
    assert _split(QWEN3, ASSISTANT, THOUGHT) == ("The user asks for the capital.\nIt is Paris.", "Paris.")
    assert _split(QWEN3, ASSISTANT, "<think>\n\n</think>\n\nHi.") == ("", "Hi.")  # an empty block
    assert _split(QWEN3, ASSISTANT, "<think>\nStill thinking when max_tokens") == (
        "Still thinking when max_tokens", "")  # cut short inside the block: all reasoning


def test_qwen3_without_a_block_is_all_answer_as_written() -> None:
    assert _split(QWEN3, ASSISTANT, "\nParis.") == ("", "\nParis.")
    assert _split(QWEN3, ASSISTANT, "a </think> b") == ("", "a </think> b")  # no block opened: plain text
    assert _split(QWEN3, ASSISTANT, "<thi") == ("", "<thi")  # ended before an open tag was whole


def test_output_that_starts_inside_the_block_the_template_opened() -> None:
    assert _split(QWEN3, OPENED, "The capital.\n</think>\n\nParis.") == ("The capital.", "Paris.")
    # a model that writes the open tag again (trained on the older template) loses nothing
    assert _split(QWEN3, OPENED, THOUGHT) == ("The user asks for the capital.\nIt is Paris.", "Paris.")
    assert _split(QWEN3, OPENED, "cut short") == ("cut short", "")


def test_enable_thinking_false_closes_the_block_in_the_prompt() -> None:
    assert ReasoningPlan.for_prompt(QWEN3, CLOSED).phase is Phase.CONTENT
    assert _split(QWEN3, CLOSED, "Paris.") == ("", "Paris.")


def test_deepseek_r1_reasons_until_the_close_tag_even_unopened() -> None:
    assert _split(R1, ASSISTANT, "Hmm, France.\n</think>\n\nParis.") == ("Hmm, France.", "Paris.")
    assert _split(R1, ASSISTANT, THOUGHT) == ("The user asks for the capital.\nIt is Paris.", "Paris.")
    assert _split(R1, ASSISTANT, "never closed") == ("never closed", "")


def test_a_constrained_output_is_the_answer() -> None:
    """A grammar holds from the first token: the JSON it forced is the answer, even where the prompt opened a
    block or the parser would read unopened text as reasoning."""
    assert ReasoningPlan.for_prompt(QWEN3, OPENED, constrained=True).phase is Phase.START
    assert _split(QWEN3, OPENED, '{"a": 1}', constrained=True) == ("", '{"a": 1}')
    assert _split(R1, ASSISTANT, '{"a": 1}', constrained=True) == ("", '{"a": 1}')


def test_qwen3_a_tool_call_inside_the_block_ends_it() -> None:
    text = f"<think>\nI need the weather.\n{CALL}"
    assert _split(QWEN3, ASSISTANT, text, tool_calls=True) == ("I need the weather.", CALL)
    assert _split(QWEN3, ASSISTANT, text) == (f"I need the weather.\n{CALL}", "")  # no tool parsing: reasoning
    assert _split(R1, ASSISTANT, text, tool_calls=True)[1] == ""  # R1 closes its block first


TEXTS = [THOUGHT, "Hmm </thi nk> x \n </think>\n\n  y  ", "<think>a</think>", "  <think>\n\n</think>b", "\n\n",
         f"<think>w\n{CALL}", "<think><think>q</think>r", "plain text < > </", "x  \n  </think>y"]


@pytest.mark.parametrize("syntax", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("tail", [ASSISTANT, OPENED, CLOSED], ids=["model-opens", "prompt-opens", "closed"])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_the_whole_split(syntax, tail: str, text: str) -> None:
    plan = ReasoningPlan.for_prompt(syntax, tail, tool_calls=True)
    whole = plan.split(text)
    rng = random.Random(text)
    for cuts in [list(range(len(text) + 1)), *(sorted(rng.sample(range(len(text) + 1), min(4, len(text))))
                                               for _ in range(20))]:
        scanner, reasoning, content = ReasoningScanner(plan), "", ""
        for end in [*cuts, len(text)]:
            piece = scanner.feed(text[:end])
            reasoning, content = reasoning + piece.reasoning, content + piece.content
        piece = scanner.feed(text, final=True)
        assert (reasoning + piece.reasoning, content + piece.content) == whole, cuts


def test_reasoning_streams_as_it_is_written_holding_back_only_a_possible_tag() -> None:
    scanner = ReasoningScanner(ReasoningPlan.for_prompt(QWEN3, ASSISTANT))
    assert scanner.feed("<thi").reasoning == ""  # may become the open tag
    assert scanner.feed("<think>\nStep one").reasoning == "Step one"
    assert scanner.feed("<think>\nStep one. </th").reasoning == "."  # the space and "</th" wait
    piece = scanner.feed("<think>\nStep one. </think>\n\nDone")
    assert (piece.reasoning, piece.content) == ("", "Done")


def _message(output: ChatOutput, text: str, finish_reason: str = "stop") -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    return output.shape_message(choice, text, finish_reason)


def test_message_shape_with_reasoning_and_without() -> None:
    output = ChatOutput(reasoning=ReasoningPlan.for_prompt(QWEN3, ASSISTANT))
    message = _message(output, THOUGHT)["message"]
    assert message["content"] == "Paris."
    assert message["reasoning"] == message["reasoning_content"] == "The user asks for the capital.\nIt is Paris."
    plain = _message(output, "Paris.")["message"]
    assert plain["content"] == "Paris." and plain["reasoning"] is None and plain["reasoning_content"] is None
    cut = _message(output, "<think>\nhalf", "length")
    assert cut["message"]["content"] is None and cut["message"]["reasoning"] == "half"


def test_tool_calls_are_read_out_of_the_answer_only() -> None:
    output = ChatOutput(TOOLS, ReasoningPlan.for_prompt(QWEN3, ASSISTANT, tool_calls=True))
    choice = _message(output, f"<think>\nCall the tool.\n</think>\n\n{CALL}")
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Call the tool." and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # a call written inside the reasoning, without closing it (Qwen3.5), is still a call
    choice = _message(output, f"<think>\nCall the tool.\n{CALL}")
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"] == "Call the tool."
    # a block that only mentions a call's tag is reasoning, and calls nothing
    closed = ChatOutput(TOOLS, ReasoningPlan.for_prompt(R1, ASSISTANT, tool_calls=True))
    choice = _message(closed, f"<think>Maybe {CALL}?</think>No call.")
    assert "tool_calls" not in choice["message"] and choice["message"]["content"] == "No call."


def _stream(output: ChatOutput, text: str, step: int = 3) -> tuple[list[dict], dict]:
    stream, deltas = output.stream(), []
    for end in range(step, len(text), step):
        delta = stream.running(text[:end])
        if delta is not None:
            deltas.append(delta)
    chunk = {"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": "stop"}
    return deltas, stream.final(chunk, text, "stop")


def test_stream_sends_reasoning_deltas_then_content() -> None:
    deltas, last = _stream(ChatOutput(reasoning=ReasoningPlan.for_prompt(QWEN3, ASSISTANT)), THOUGHT)
    everything = [*deltas, last["delta"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in everything)
    assert reasoning == "".join(d.get("reasoning", "") for d in everything)
    assert reasoning == "The user asks for the capital.\nIt is Paris."
    assert "".join(d.get("content", "") for d in everything) == "Paris."
    first_content = next(i for i, d in enumerate(everything) if "content" in d)
    assert all("reasoning" not in d for d in everything[first_content + 1:])  # reasoning first, then the answer
    assert last["finish_reason"] == "stop"


def test_stream_with_tools_sends_reasoning_and_the_calls_last() -> None:
    output = ChatOutput(TOOLS, ReasoningPlan.for_prompt(QWEN3, ASSISTANT, tool_calls=True))
    deltas, last = _stream(output, f"<think>\nCall it.\n</think>\n\nChecking.\n{CALL}")
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Call it."
    assert "".join(d.get("content", "") for d in deltas) == "Checking.\n"
    assert not any("<tool" in d.get("content", "") for d in deltas)
    assert last["finish_reason"] == "tool_calls" and last["delta"]["tool_calls"][0]["function"]["name"] == \
        "get_weather"


def test_unknown_parser_is_refused_at_start_up() -> None:
    assert ServerArgs(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ServerConfigError, match="--reasoning-parser 'granite' is not one kvpilot has: use one of "
                                                "qwen3, deepseek_r1"):
        ServerArgs(reasoning_parser="granite")
