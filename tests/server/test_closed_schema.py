"""Issue 46 item 4: forced tool calls (and response_format json_schema with strict true) never repeat a key nor
add one the schema does not list. close_schema adds `additionalProperties: false` where an object lists its
properties and leaves other keys unsaid; the compiled llguidance grammar (embedded tokenizer) then refuses a
repeated or unlisted key, where the open grammar lets the model write `"description"` again and again."""

from __future__ import annotations

import copy

import pytest
from llguidance import LLMatcher

from kvpilot.fit.gguf_metadata import open_gguf
from kvpilot.model.tokenizer import tokenizer_from_gguf
from kvpilot.server.openai.protocol import ChatCompletionRequest
from kvpilot.server.openai.tool_calls import ToolCallPlan
from kvpilot.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from kvpilot.structured_outputs.closed_schema import close_schema
from kvpilot.structured_outputs.matchers import compile_matcher, ll_tokenizer

# The issue's shape: listed properties with descriptions, no additionalProperties.
LOCATION = {"type": "object", "properties": {"location": {"type": "string", "description": "The city, e.g. Paris"},
                                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["location"]}
REPEATED = '{"location": "Paris", "description": "x", "description": "y"}'


@pytest.fixture(scope="module")
def ll_tok(gguf_path):
    tokenizer = tokenizer_from_gguf(open_gguf(gguf_path), gguf_path)
    return ll_tokenizer(tokenizer, len(tokenizer.backend.get_vocab()), tokenizer.eos_token_ids)


def _accepts(ll_tok, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar of `spec` takes all of `text` (and may end there)."""
    matcher = compile_matcher(ll_tok, spec)
    tokens = ll_tok.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and \
        matcher.is_accepting()


def test_close_schema_closes_objects_that_list_properties() -> None:
    nested = {"type": "object", "properties": {
        "place": LOCATION, "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "string"}]},
        "free": {"type": "object"}, "open": {"type": "object", "properties": {"b": {}}, "additionalProperties": True},
        "const": {"const": {"properties": {"x": 1}}}},
        "$defs": {"d": {"type": "object", "properties": {"c": {}}}}}
    before = copy.deepcopy(nested)
    closed = close_schema(nested)
    assert nested == before  # the input is not changed
    assert closed["additionalProperties"] is False and closed["properties"]["place"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["free"]  # free-form: closing it would allow only {}
    assert closed["properties"]["open"]["additionalProperties"] is True  # what the schema says stands
    assert closed["properties"]["const"] == {"const": {"properties": {"x": 1}}}  # data is not a schema


def test_all_of_members_stay_open_so_their_properties_add_up(ll_tok) -> None:
    merged = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "integer", "minimum": 0}}}]}
    closed = close_schema(merged)
    assert all("additionalProperties" not in member for member in closed["allOf"])
    spec = StructuredOutputsParams(json=merged, disable_additional_properties=True)
    assert _accepts(ll_tok, spec, '{"a": 1, "b": 2}')


def test_the_closed_grammar_refuses_a_repeated_or_unlisted_key(ll_tok) -> None:
    open_spec = StructuredOutputsParams(json=LOCATION)
    closed_spec = StructuredOutputsParams(json=LOCATION, disable_additional_properties=True)
    assert _accepts(ll_tok, open_spec, REPEATED)  # the hazard: JSON Schema's default admits any other key
    assert not _accepts(ll_tok, closed_spec, REPEATED)
    assert not _accepts(ll_tok, closed_spec, '{"location": "Paris", "location": "Rome"}')
    assert _accepts(ll_tok, closed_spec, '{"location": "Paris", "unit": "celsius"}')
    assert _accepts(ll_tok, closed_spec, '{"location": "Paris"}')
    assert open_spec.cache_key() != closed_spec.cache_key()  # each has its own cached grammar


def test_forced_tool_calls_compile_closed(ll_tok) -> None:
    required = ToolCallPlan({"get_weather": LOCATION}).spec()
    named = ToolCallPlan({"get_weather": LOCATION}, named="get_weather").spec()
    assert required is not None and named is not None
    assert not _accepts(ll_tok, named, REPEATED)
    assert not _accepts(ll_tok, required, f'[{{"name": "get_weather", "parameters": {REPEATED}}}]')
    assert _accepts(ll_tok, required, '[{"name": "get_weather", "parameters": {"location": "Paris"}}]')


def _response_format_spec(strict: bool | None) -> StructuredOutputsParams:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], response_format={
        "type": "json_schema", "json_schema": {"name": "loc", "schema": LOCATION, "strict": strict}})
    spec = body.structured_outputs_params()
    assert spec is not None
    return spec


def test_response_format_strict_true_closes_the_schema(ll_tok) -> None:
    assert not _accepts(ll_tok, _response_format_spec(True), REPEATED)
    assert _accepts(ll_tok, _response_format_spec(None), REPEATED)  # not strict: the schema as JSON Schema reads it
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": LOCATION}}]
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                 tool_choice="required")
    spec = body.structured_outputs_params()
    assert spec is not None and spec.disable_additional_properties


def test_disable_additional_properties_is_for_json_schemas_only() -> None:
    with pytest.raises(StructuredOutputsError, match="applies to a JSON schema"):
        StructuredOutputsParams(regex="a+", disable_additional_properties=True)
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], structured_outputs={
        "json": LOCATION, "disable_additional_properties": True})
    spec = body.structured_outputs_params()
    assert spec is not None and '"additionalProperties":false' in spec.cache_key()[1]
    assert LLMatcher.grammar_from_json_schema(spec.cache_key()[1]) == spec.grammar_text()
