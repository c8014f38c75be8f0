"""close_schema: a JSON schema whose objects admit only the keys they list (OpenAI's strict mode; vLLM's
`disable_additional_properties`).

llguidance generates an object's listed `properties` in order, each at most once, but keys beyond them, when
the schema allows any (JSON Schema's default: `additionalProperties` unset), are a free loop that a grammar
cannot keep from repeating a key. So every object schema that lists `properties` and says nothing of other
keys (no `additionalProperties`, no `unevaluatedProperties`) gets `additionalProperties: false`: its output
holds only its own keys, each once, and the object must close after them.

Left as written: an object schema without `properties` (a free-form object: closing it would allow only `{}`),
one that sets `additionalProperties` itself, and the members of an `allOf` and the schema holding it (their
properties add up, so closing one member would forbid the others' keys); the schemas nested in them are
closed. Data keywords (`enum`, `const`, `default`, `examples`) are never walked. The input is not changed.
"""

from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")  # `items` as a list: draft 4's tuples
_SCHEMA_ONES = ("items", "additionalProperties", "additionalItems", "unevaluatedItems", "unevaluatedProperties",
                "not", "if", "then", "else", "contains", "propertyNames")
_OTHER_KEYS = ("additionalProperties", "unevaluatedProperties")


def close_schema(schema: Any, *, close: bool = True) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that lists `properties` and leaves
    other keys unsaid (`close=False`: not on this one, only on those nested in it). Booleans and other
    non-schemas come back as they are."""
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: close_schema(sub) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            closed[key] = [close_schema(sub, close=False) for sub in value]
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            closed[key] = [close_schema(sub) for sub in value]
        elif key in _SCHEMA_ONES:
            closed[key] = close_schema(value)
        else:
            closed[key] = value
    if close and "properties" in schema and "allOf" not in schema and not any(k in schema for k in _OTHER_KEYS):
        closed["additionalProperties"] = False
    return closed
