"""Renders a model's Jinja chat template the way transformers does (same environment and helpers)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, bad roles, or the template itself raised)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template: str | None, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, **special_tokens: Any) -> str:
    """The prompt text for `messages`; raises ChatTemplateError with a clear message on bad input. `tools`
    reaches the template as `tools` (None when there are none), in transformers' shape: a list of
    `{"type": "function", "function": {"name", "description", "parameters"}}`; whether the template renders
    them is up to the template."""
    if not template:
        raise ChatTemplateError("this model has no chat template; use generate() with a plain prompt instead")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **special_tokens)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template failed: {exc}") from exc
