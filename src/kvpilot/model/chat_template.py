"""Renders a model's Jinja chat template the way transformers does (same environment and helpers).

The constructs the families' templates use all render: `raise_exception(msg)` (Gemma refuses a system turn,
Mistral a turn out of order: a ChatTemplateError naming the template's own message, which the server answers
with a 400), `strftime_now(fmt)` (Llama 3.1+ dates its system prompt), `tojson`, loop controls, and
`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens with it for training
masks; rendering, it writes its body unchanged). Request-level variables (`chat_template_kwargs`, e.g. Qwen3's
`enable_thinking`) reach the template beside the special tokens and win over them, as in transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

# what render_chat itself passes: a request's template variables may not replace them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, bad roles, or the template itself raised)."""


class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: the body, rendered as if the tags were not there."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)  # the `generation` name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the model's chat template refuses these messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the model's chat template does not parse (line {exc.lineno}: {exc.message})") \
            from exc


def chosen_template(value: Any) -> str | None:
    """The chat template of a tokenizer config's `chat_template` value: a string, or the older list of named
    templates (`[{"name": "default", "template": ...}, {"name": "tool_use", ...}]`), of which the default one
    (else the first) is taken; None when there is none."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) and chosen else None
    return None


def render_chat(template: str | None, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, template_kwargs: Mapping[str, Any] | None = None,
                **special_tokens: Any) -> str:
    """The prompt text for `messages`; raises ChatTemplateError with a clear message on bad input. `tools`
    reaches the template as `tools` (None when there are none), in transformers' shape: a list of
    `{"type": "function", "function": {"name", "description", "parameters"}}`; whether the template renders
    them is up to the template. `template_kwargs`: more template variables (never the reserved ones)."""
    if not template:
        raise ChatTemplateError("this model has no chat template; use generate() with a plain prompt instead")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
    clash = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(template_kwargs or {}))
    if clash:
        raise ChatTemplateError(f"chat template variables may not set {', '.join(clash)}: send them as the "
                                "request's own fields")
    variables = {**special_tokens, **(template_kwargs or {})}
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template failed: {exc}") from exc
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        # a template that meets a shape it did not expect (e.g. `content + 1`): the messages' fault, not a crash
        raise ChatTemplateError(f"the model's chat template failed on these messages: {type(exc).__name__}: "
                                f"{exc}") from exc
