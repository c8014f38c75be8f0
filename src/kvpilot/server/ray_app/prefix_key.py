"""The routing key of a request: chained hashes of its prompt's leading chunks, so two prompts that share
their first k chunks share their first k hashes (as the engine's KV blocks share block hashes).

The router sees text, not tokens (tokenizing in the ingress would double the work), so a chunk is
CHUNK_CHARS characters of a canonical prompt text (token-id prompts: CHUNK_TOKENS ids). Hashes are blake2b,
stable across processes and restarts (never Python's salted hash()).
"""

from __future__ import annotations

import hashlib
from typing import Any

CHUNK_CHARS = 64
CHUNK_TOKENS = 16
MAX_CHUNKS = 256  # 16k characters: beyond that, a longer shared prefix changes nothing about the choice
_ROLE_END, _MESSAGE_END = "\x1f", "\x1e"


def prompt_text(body: Any) -> str | list[int]:
    """The part of an OpenAI request body that the engine's prefix cache sees first: chat messages
    (role, content) in order, or a completion's prompt (text, or token ids). Anything else: ""."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: the first decides (they usually share a prefix)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return ""


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text, in order
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return f"{message.get('role', '')}{_ROLE_END}{content or ''}{_MESSAGE_END}"


def route_key(prompt: str | list[int]) -> tuple[int, ...]:
    """Chained 8-byte hashes of the prompt's whole chunks (a partial last chunk is left out: it cannot be a
    shared prefix block yet), at most MAX_CHUNKS."""
    if isinstance(prompt, str):
        chunks = [prompt[i:i + CHUNK_CHARS].encode() for i in range(0, len(prompt) - CHUNK_CHARS + 1, CHUNK_CHARS)]
    else:
        chunks = [b",".join(str(t).encode() for t in prompt[i:i + CHUNK_TOKENS])
                  for i in range(0, len(prompt) - CHUNK_TOKENS + 1, CHUNK_TOKENS)]
    keys: list[int] = []
    parent = b""
    for chunk in chunks[:MAX_CHUNKS]:
        parent = hashlib.blake2b(parent + chunk, digest_size=8).digest()
        keys.append(int.from_bytes(parent, "big"))
    return tuple(keys)


def prompt_chars(prompt: str | list[int]) -> int:
    """The prompt's size for lane choice: characters, or about 4 characters a token for token ids."""
    return len(prompt) if isinstance(prompt, str) else 4 * len(prompt)
