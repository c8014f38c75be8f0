"""StructuredOutputsParams: a request's output constrained to a grammar (vLLM's field names and meaning).

Exactly one of `json` (a JSON schema, as a dict or its text), `json_object` (any JSON object), `regex`,
`choice` (one of these strings) or `grammar` (Lark, or llama.cpp's GBNF) is set; `disable_additional_properties`
closes a schema's objects to the keys they list (closed_schema.py: OpenAI's strict mode, used for tool calls and
response_format with strict true). The spec is plain data:
it pickles into the engine core and costs nothing until a request uses it. `grammar_text()` turns it into
an llguidance grammar and `check()` validates that under GrammarLimits (limits.py), without a tokenizer
(both import llguidance lazily, so this package stays importable without it). With the model's tokenizer,
GrammarAdmission (admission.py) compiles and probes it before the HTTP process lets it reach the engine; the
runner's matchers compile the same text (matchers.py, model/grammar_state.py).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from kvpilot.structured_outputs.closed_schema import close_schema
from kvpilot.structured_outputs.limits import GRAMMAR_LIMITS, GrammarLimits, bounded, explain

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(ValueError):
    """The structured-outputs spec is malformed or its grammar does not compile; the message says why."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Invariants (checked in __post_init__): exactly one kind is set; json is a dict or a JSON text of an
    object schema; regex and grammar are non-empty strings; choice is a non-empty list of strings;
    disable_additional_properties (vLLM's name) is set only with json or json_object."""

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(f"structured_outputs: set exactly one of {', '.join(KINDS)}, got "
                                         f"{given or 'none'}")
        if self.disable_additional_properties not in (True, False):
            raise StructuredOutputsError("structured_outputs.disable_additional_properties must be true or false")
        if self.disable_additional_properties and given[0] not in ("json", "json_object"):
            raise StructuredOutputsError(f"structured_outputs.disable_additional_properties applies to a JSON "
                                         f"schema: leave it out with {given[0]}")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as exc:
                raise StructuredOutputsError(f"structured_outputs.json: not valid JSON ({exc})") from None
            if not isinstance(parsed, dict):
                raise StructuredOutputsError("structured_outputs.json: a JSON schema is an object")
        elif self.json is not None and not isinstance(self.json, dict):
            raise StructuredOutputsError(f"structured_outputs.json must be a schema (dict or JSON text), got "
                                         f"{type(self.json).__name__}")
        if self.json_object not in (None, True, False):
            raise StructuredOutputsError("structured_outputs.json_object must be true or false")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputsError(f"structured_outputs.{kind} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise StructuredOutputsError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """(kind, canonical text): equal specs have equal keys. A schema keeps its key order (it is the
        order the properties are generated in); with disable_additional_properties it is the closed schema
        (what is compiled)."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            if self.disable_additional_properties:
                schema = close_schema(schema)
            return kind, json.dumps(schema, separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, str(getattr(self, kind))

    @property
    def num_chars(self) -> int:
        """The size of the spec's text (what max_grammar_chars limits)."""
        return len(self.cache_key()[1])

    def check_size(self, limits: GrammarLimits = GRAMMAR_LIMITS) -> None:
        """StructuredOutputsError unless the spec's text is within max_grammar_chars (checked before compiling)."""
        if self.num_chars > limits.max_grammar_chars:
            raise StructuredOutputsError(
                f"structured_outputs.{self.kind}: the grammar is {self.num_chars:,} characters, over the limit of "
                f"{limits.max_grammar_chars:,} (max_grammar_chars): send a smaller schema, regex or grammar, or "
                "fewer choices")

    def grammar_text(self) -> str:
        """The llguidance grammar (StructuredOutputsError if the spec cannot be converted)."""
        return _grammar_text(self.cache_key())

    def check(self, limits: GrammarLimits = GRAMMAR_LIMITS) -> None:
        """StructuredOutputsError (naming what is wrong, and the limit if one was hit) unless the spec is within
        max_grammar_chars and its grammar compiles under `limits`. Needs no tokenizer; cached by spec."""
        self.check_size(limits)
        error = _validate(self.cache_key(), limits)
        if error:
            raise StructuredOutputsError(f"structured_outputs.{self.kind}: the grammar does not compile: "
                                         f"{explain(error, limits)}")


@functools.lru_cache(maxsize=256)
def _grammar_text(key: tuple[str, str]) -> str:
    from llguidance import LLMatcher, grammar_from

    kind, text = key
    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(text)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if kind == "regex":
            return LLMatcher.grammar_from_regex(text)
        return grammar_from("choice" if kind == "choice" else "grammar", text)
    except ValueError as exc:
        raise StructuredOutputsError(f"structured_outputs.{kind}: {bounded(str(exc))}") from None


@functools.lru_cache(maxsize=256)
def _validate(key: tuple[str, str], limits: GrammarLimits) -> str:
    """'' when the grammar of `key` compiles under `limits`, else llguidance's error message."""
    from llguidance import LLMatcher

    try:
        grammar = _grammar_text(key)
    except StructuredOutputsError as exc:
        return str(exc)
    return LLMatcher.validate_grammar(grammar, limits=limits.ll_limits())
