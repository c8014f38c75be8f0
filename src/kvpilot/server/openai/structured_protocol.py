"""Request fields that constrain the output: OpenAI's `response_format`, `tools` / `tool_choice`, and vLLM's
`structured_outputs` and `guided_*` extras. They become one StructuredOutputsParams, its shape validated
here; its grammar is compiled and probed for the model's tokenizer by GrammarAdmission, in the tokenizer
pool (serving.py; llguidance needs no torch): a bad or too costly spec is a 400 naming the field it came from.

Never silently ignored: fields kvpilot does not implement (`functions`, `function_call`,
`guided_decoding_backend` other than guidance, `guided_whitespace_pattern`, response_format types other than
text / json_object / json_schema, tool_choice "auto" where the server has it off: auto_tool_choice.py) are
400s naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from kvpilot.server.openai.errors import APIError
from kvpilot.server.openai.tool_calls import EMPTY_PARAMETERS, ToolCallPlan
from kvpilot.structured_outputs import StructuredOutputsError, StructuredOutputsParams

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)
AUTO_TOOL_CHOICE_MESSAGE = ('tool_choice: "auto" (the default when tools are given) is off on this server (it was '
                            'started with --no-enable-auto-tool-choice, or its model\'s chat template writes tool '
                            'calls in a format no tool-call parser reads: its start-up log says which); send '
                            'tool_choice "required", "none" or {"type": "function", "function": {"name": ...}}, or '
                            'restart it with --enable-auto-tool-choice --tool-call-parser hermes if the model '
                            'writes <tool_call> blocks')


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field (its StructuredOutputsParams, as JSON)."""

    model_config = _STRICT

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_additional_properties: bool | None = None


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDefinition


def template_tools(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template receives them (transformers' shape, unset fields left out; None
    without tools)."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


class NamedFunction(BaseModel):
    model_config = _STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: NamedFunction


def _spec(param: str, **fields: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams of a well-formed spec (its grammar is not compiled here), else a 400 naming
    `param`."""
    try:
        return StructuredOutputsParams(**fields)
    except StructuredOutputsError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None


class StructuredFields(BaseModel):
    """Mixed into both endpoints' request bodies."""

    model_config = _STRICT

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    def _refuse_unsupported(self) -> None:
        for name in ("functions", "function_call", "guided_whitespace_pattern"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported by kvpilot: leave it out (use tools / tool_choice "
                                    "for function calling)", param=name)
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            raise APIError(400, f"guided_decoding_backend: kvpilot constrains outputs with llguidance only, got "
                                f"{self.guided_decoding_backend!r}", param="guided_decoding_backend")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for (None: unconstrained); APIError 400 naming the field
        for a malformed spec or for two constraints at once."""
        constraint = self.structured_outputs_constraint()
        return constraint[1] if constraint is not None else None

    def structured_outputs_constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """(the field it came from, the spec) of the one output constraint, as structured_outputs_params."""
        self._refuse_unsupported()
        given: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format: type json_schema needs json_schema.schema (a JSON schema "
                                    "object)", param="response_format")
            # strict: OpenAI's strict mode, objects hold only the keys they list (closed_schema.py)
            given.append(("response_format", {"json": rf.json_schema.schema_,
                                              "disable_additional_properties": rf.json_schema.strict is True}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given.append(("structured_outputs", {"json": so.json_, "json_object": so.json_object,
                                                 "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                                                 "disable_additional_properties": bool(
                                                     so.disable_additional_properties)}))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, {kind: getattr(self, name)}))
        given.extend(self._tool_constraint())
        if len(given) > 1:
            names = [name for name, _ in given]
            raise APIError(400, f"{names[1]}: only one output constraint per request, got {', '.join(names)}",
                           param=names[1])
        if not given:
            return None
        param, fields = given[0]
        return param, _spec(param, **fields)

    def _tool_constraint(self) -> list[tuple[str, dict[str, Any]]]:
        return []


class ToolFields(StructuredFields):
    """Chat only: `tools` and `tool_choice` (see tool_calls.py). The tools reach the chat template whatever
    tool_choice says ("none" included, as in vLLM): see tool_prompt.py."""

    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # The parser of tool_choice "auto" on this server (None: "auto" is a 400); auto_tool_choice.py decides.
    _auto_tool_parser: str | None = PrivateAttr(default=None)

    def allow_auto_tool_choice(self, parser: str | None) -> None:
        """Set by the route from the server's flags before the request is prepared."""
        self._auto_tool_parser = parser

    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools)

    def tool_call_plan(self) -> ToolCallPlan | None:
        """What tool_choice asks for (None: no call forced or parsed); APIError 400 for "auto" on a server
        without a tool-call parser and for bad references."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise APIError(400, "tool_choice: set tools too (a tool choice needs tools to choose from)",
                               param="tool_choice")
            return None
        if choice == "none":
            return None
        if (choice is None or choice == "auto") and self._auto_tool_parser is None:
            raise APIError(400, AUTO_TOOL_CHOICE_MESSAGE, param="tool_choice")
        parameters = {tool.function.name: tool.function.parameters or EMPTY_PARAMETERS for tool in self.tools}
        if len(parameters) != len(self.tools):
            raise APIError(400, "tools: function names must be unique", param="tools")
        if choice is None or choice == "auto":
            return ToolCallPlan(parameters, parallel=self.parallel_tool_calls is not False,
                                parser=self._auto_tool_parser)
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in parameters:
                raise APIError(400, f"tool_choice: function {choice.function.name!r} is not in tools "
                                    f"({', '.join(parameters)})", param="tool_choice")
            return ToolCallPlan(parameters, named=choice.function.name)
        return ToolCallPlan(parameters, parallel=self.parallel_tool_calls is not False)

    def _tool_constraint(self) -> list[tuple[str, dict[str, Any]]]:
        plan = self.tool_call_plan()
        spec = plan.spec() if plan is not None else None
        return [] if spec is None else [("tools", {"json": spec.json, "disable_additional_properties":
                                                   spec.disable_additional_properties})]
