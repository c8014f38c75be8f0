"""Field types shared by the request models, and the bounds their JSON schema (/openapi.json) states.

The schema says what the server accepts, so that a client generated from it sends valid requests: minimum
lengths, the sampling fields' ranges, token ids' bounds. Where the server's own check gives the better
message (SamplingParams' words, shared with the offline API; "outside the vocabulary", which needs the model),
the bound is stated in the schema only (WithJsonSchema, `bounded`) and checked there; the schemathesis test
(tests/server/test_reliability_schemathesis.py) holds the two together.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema

from kvpilot.sampling_params import MAX_LOGIT_BIAS

TOKEN_ID_KEY = re.compile("[0-9]+")  # a logit_bias key: a token id written in ASCII digits


def integral(value: Any) -> Any:
    """An integral float as the int it is (JSON Schema's integer: 8.0 is 8); anything else unchanged, for the
    strict int check to judge (8.5, "8" and true stay 400s)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(integral)]  # bounded: Annotated[int, Field(ge=..), BeforeValidator(integral)]
# A token id. Its bounds (0 <= id < the model's vocabulary size) are checked with the model at hand (a 400
# "outside the vocabulary"); openapi_contract.py makes every schema titled TokenId a reference to one
# component with the served model's bound.
TOKEN_ID_TITLE = "TokenId"
TOKEN_ID_SCHEMA: dict[str, Any] = {"type": "integer", "minimum": 0, "title": TOKEN_ID_TITLE,
                                   "description": "A token id of the served model: 0 <= id < its vocabulary size."}
TokenId = Annotated[Int, WithJsonSchema(TOKEN_ID_SCHEMA)]
_TOKEN_IDS: dict[str, Any] = {"type": "array", "minItems": 1, "items": TOKEN_ID_SCHEMA}
PROMPT_SCHEMA: dict[str, Any] = {"title": "Prompt", "anyOf": [
    {"type": "string", "minLength": 1}, _TOKEN_IDS,
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]}
STOP_SCHEMA: dict[str, Any] = {"title": "Stop", "anyOf": [
    {"type": "string"}, {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}]}
LOGIT_BIAS_SCHEMA: dict[str, Any] = {"title": "Logit Bias", "anyOf": [
    {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
     "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}},
    {"type": "null"}]}


def bounded(**bounds: float) -> Any:
    """An optional field whose JSON schema states the range SamplingParams checks (the check, and its words,
    stay there: the offline API shares them)."""
    return Field(default=None, json_schema_extra=bounds)
