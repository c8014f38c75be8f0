"""A request's prompt -> token ids. Runs in a TokenizerPool worker thread, never on the event loop.

Everything here may take seconds for a huge prompt (10 MB of text: ~5 s on one core), so it must leave
the GIL to the event loop while it works:

* Text goes through `tokenizers`' `encode_batch_fast`, which releases the GIL while it encodes.
  `Tokenizer.encode` (kvpilot's, over `tokenizers`' `encode`) holds it for the whole call: measured on
  10 MB of text, a thread in `encode` froze the main thread for 10 s, in `encode_batch` for 0.6 s (freeing
  the Encoding and its offsets), in `encode_batch_fast` (no offsets) for 0.04 s.
* A prompt longer than the cap is counted (`len(encoding)`) but its ids are never turned into a Python
  list: building 3.4 M ints holds the GIL ~0.1 s, for a request that is rejected anyway.
* Chat-template rendering, the vocabulary check and copies of token-id prompts are Python code: they
  give the GIL back every few milliseconds (sys.getswitchinterval), so the loop keeps running.

The result is the same as `Tokenizer.encode` / `Tokenizer.encode_chat` (tests check it); a tokenizer
without a `tokenizers` backend falls back to its own `encode`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvpilot.server.openai.errors import APIError
from kvpilot.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.server.openai.tool_prompt import render_chat_prompt


class PromptTooLongError(APIError):
    """400 context_length_exceeded: the prompt alone leaves no room for one generated token."""


@dataclass(frozen=True)
class TokenizedPrompt:
    """Invariants: `token_ids` is None only when `num_tokens` > the cap it was tokenized with (too long to
    ever run, so never materialized); otherwise len(token_ids) == num_tokens >= 1 and every id is in the
    vocabulary. `text` is the prompt text of a text completion (None for chat and token-id prompts);
    `chat_tail` the last CHAT_TAIL_CHARS characters of a chat's rendered prompt ("" otherwise): what the
    template ends it with, e.g. an opened `<think>` block (openai/reasoning_parser.py reads it)."""

    token_ids: list[int] | None
    num_tokens: int
    text: str | None = None
    chat_tail: str = ""


CHAT_TAIL_CHARS = 64


def prompt_size(body: CompletionRequest | ChatCompletionRequest) -> int:
    """Characters (or token ids) to tokenize, read without copying: picks the pool's lane."""
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str) else
                   sum(len(str(p.get("text", ""))) for p in m.content or []) for m in body.messages)
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return len(prompt)


def tokenize_request(body: CompletionRequest | ChatCompletionRequest, tokenizer: Any, vocab_size: int,
                     max_num_tokens: int) -> TokenizedPrompt:
    """The request's prompt as checked token ids (see TokenizedPrompt; its ids are never None here); APIError
    400 for an unusable prompt or a token id field outside the vocabulary; PromptTooLongError for a prompt
    that leaves no room for one token in `max_num_tokens` (max_model_len: the prompt is at fault then, param
    `prompt` / `messages`, whatever max_tokens says)."""
    check_token_id_fields(body, vocab_size)
    prompt = _tokenize(body, tokenizer, vocab_size, max_num_tokens)
    if prompt.num_tokens >= max_num_tokens:
        raise _too_long(prompt.num_tokens, max_num_tokens, "messages" if isinstance(body, ChatCompletionRequest)
                        else "prompt")
    return prompt


def _too_long(num_tokens: int, max_model_len: int, param: str) -> PromptTooLongError:
    return PromptTooLongError(400, f"{param}: the prompt has {num_tokens} tokens, but this model's maximum context "
                                   f"length is {max_model_len} tokens (max_model_len), which must also hold at least "
                                   "one generated token: shorten the prompt", param=param,
                              code="context_length_exceeded")


def check_token_id_fields(body: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> None:
    """400 for stop_token_ids or logit_bias keys outside the vocabulary (0..vocab_size-1) (logit_bias values
    are range-checked by SamplingParams)."""
    for param, ids in (("stop_token_ids", body.stop_token_ids or []), ("logit_bias", body.logit_bias_ids())):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"{param}: token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})",
                           param=param)


def _tokenize(body: CompletionRequest | ChatCompletionRequest, tokenizer: Any, vocab_size: int,
              max_num_tokens: int) -> TokenizedPrompt:
    if isinstance(body, ChatCompletionRequest):
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions with "
                                "token ids", param="messages")
        try:
            text = render_chat(tokenizer, body.conversation(), body.add_generation_prompt, body.template_tools(),
                               body.chat_template_kwargs)
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from exc
        prompt = _checked(encode(tokenizer, text, False, max_num_tokens), vocab_size)
        return dataclasses.replace(prompt, chat_tail=text[-CHAT_TAIL_CHARS:])
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids",
                           param="prompt")
        ids = encode(tokenizer, prompt, True, max_num_tokens)
        return _checked(ids, vocab_size, text=prompt)
    ids = TokenizedPrompt(list(prompt) if len(prompt) <= max_num_tokens else None, len(prompt))
    return _checked(ids, vocab_size)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat-templated prompt text (as Tokenizer.encode_chat renders it before encoding); tools, tool
    calls and tool results the template would drop are written into the messages (openai/tool_prompt.py);
    `template_kwargs`: the request's chat_template_kwargs (more template variables)."""
    return render_chat_prompt(tokenizer, messages, tools, add_generation_prompt, template_kwargs)


def encode(tokenizer: Any, text: str, add_special_tokens: bool, max_num_tokens: int) -> TokenizedPrompt:
    """Tokenizer.encode's ids (BOS rule included) without holding the GIL while encoding; ids of a prompt
    over `max_num_tokens` are not materialized (TokenizedPrompt.token_ids None)."""
    backend = getattr(tokenizer, "backend", None)
    encode_batch = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
    if encode_batch is None:  # not a `tokenizers`-backed Tokenizer: its own encode (may hold the GIL)
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return TokenizedPrompt(ids if len(ids) <= max_num_tokens else None, len(ids))
    encoding = encode_batch([text], add_special_tokens=add_special_tokens)[0]
    bos = _bos_to_add(tokenizer, add_special_tokens)
    if len(encoding) > max_num_tokens:  # can never run: count it, leave the ids in Rust
        return TokenizedPrompt(None, len(encoding) + _prepends_bos(tokenizer, bos, text))
    ids = encoding.ids
    if bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    return TokenizedPrompt(ids, len(ids))


def _bos_to_add(tokenizer: Any, add_special_tokens: bool) -> int | None:
    """The BOS id Tokenizer.encode prepends (unless the ids already start with it), or None."""
    if add_special_tokens and getattr(tokenizer, "add_bos", False):
        return getattr(tokenizer, "bos_token_id", None)
    return None


def _prepends_bos(tokenizer: Any, bos: int | None, text: str) -> int:
    """1 if encode would prepend BOS, judged from the text (BOS is a special token, matched verbatim), so
    the ids need not be built to read the first one."""
    bos_text = (getattr(tokenizer, "special_tokens", None) or {}).get("bos_token")
    return int(bos is not None and not (bos_text and text.startswith(bos_text)))


def _checked(prompt: TokenizedPrompt, vocab_size: int, text: str | None = None) -> TokenizedPrompt:
    """400 for a prompt of no tokens (an empty one is refused by its type: protocol.py; a text can still
    tokenize to none) or ids outside the vocabulary (Python: gives the GIL back as it goes)."""
    if prompt.num_tokens == 0:
        raise APIError(400, "prompt: the prompt's text tokenizes to no token at all; send at least one token",
                       param="prompt")
    if prompt.token_ids is not None:  # a prompt over the cap is rejected as too long, ids unchecked
        bad = [t for t in prompt.token_ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt: token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})",
                           param="prompt")
    return TokenizedPrompt(prompt.token_ids, prompt.num_tokens, text)
