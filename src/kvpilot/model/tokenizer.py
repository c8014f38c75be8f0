"""Tokenizer: encode/decode and chat templates, built from GGUF metadata or an HF model directory.

Built on the `tokenizers` library. GGUF files with a gpt2-style BPE vocabulary are converted directly
(fast); other GGUF vocabularies go through transformers' converter. The chat template is the GGUF's
`tokenizer.chat_template`, or an HF directory's chat_template.jinja (the newer layout; it wins, as in
transformers), chat_template.json or tokenizer_config.json's `chat_template`. The ids that end generation:
stop_tokens.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers

from kvpilot.fit.gguf_metadata import field_value
from kvpilot.model.chat_template import chosen_template, render_chat
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.stop_tokens import (GGUF_EOS_KEYS, end_of_turn_ids, generation_config_eos, gguf_eos_ids,
                                       merged)

GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4


@dataclass
class Tokenizer:
    """Text <-> token ids for one model.

    Invariants: `eos_token_ids` holds every id that ends generation (may be empty); `encode` adds the BOS
    token only when the model's tokenizer asks for it (`add_bos`).
    """

    backend: BackendTokenizer
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos: bool = False
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None] | None:
        """A new sequence's incremental decoder: each generated id in, the text it completes out (None while it
        ends inside a character or adds no text); the outputs add up to decode(all ids). tokenizers' DecodeStream:
        one native call a token, where re-decoding a window of ids took two. None with a tokenizers release
        without it (before 0.21)."""
        stream_class = getattr(decoders, "DecodeStream", None)
        if stream_class is None:
            return None
        stream, backend = stream_class(skip_special_tokens=skip_special_tokens), self.backend
        return lambda token_id: stream.step(backend, token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """The prompt text; `template_kwargs`: more template variables (a request's chat_template_kwargs)."""
        return render_chat(self.chat_template, messages, add_generation_prompt, tools, template_kwargs,
                           **self.special_tokens)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the chat-templated prompt (the template writes BOS itself where the model wants it)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _gguf_bpe_backend(reader: Any, tokens: list[str], token_types: list[int] | None) -> BackendTokenizer:
    merges = field_value(reader, "tokenizer.ggml.merges") or []
    token_types = token_types or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    control = [tokens[i] for i, kind in enumerate(token_types) if kind == GGUF_TOKEN_TYPE_CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    # user-defined tokens (Qwen3's <think>, <tool_call>) are matched whole, as llama.cpp does, and decode as text
    user = [tokens[i] for i, kind in enumerate(token_types) if kind == GGUF_TOKEN_TYPE_USER_DEFINED]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return backend


def _gguf_converted_backend(path: Path) -> BackendTokenizer:
    """Non-BPE GGUF vocabularies (e.g. SentencePiece 'llama'): transformers' converter (slower, correct)."""
    from transformers import AutoTokenizer

    try:
        hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot build the tokenizer from GGUF metadata ({exc})") from exc
    return hf_tok.backend_tokenizer


def _token_text(tokens: list[str] | None, token_id: int | None) -> str | None:
    if tokens is None or token_id is None or not 0 <= token_id < len(tokens):
        return None
    return tokens[token_id]


def tokenizer_from_gguf(reader: Any, path: str | Path) -> Tokenizer:
    """The tokenizer and chat template stored in a GGUF file's metadata."""
    path = Path(path)
    kind = field_value(reader, "tokenizer.ggml.model")
    tokens = field_value(reader, "tokenizer.ggml.tokens")  # decoded once: 49k strings in the embedded model
    if tokens is None:
        raise ModelLoadError(f"{path}: GGUF metadata has no tokenizer (tokenizer.ggml.tokens)")
    token_types = field_value(reader, "tokenizer.ggml.token_type")
    backend = _gguf_bpe_backend(reader, tokens, token_types) if kind == "gpt2" else _gguf_converted_backend(path)
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    eos_fields = {key: field_value(reader, key) for key in GGUF_EOS_KEYS}
    return Tokenizer(
        backend=backend,
        chat_template=chosen_template(field_value(reader, "tokenizer.chat_template")),
        bos_token_id=bos,
        eos_token_ids=gguf_eos_ids(eos_fields, tokens, token_types, GGUF_TOKEN_TYPE_CONTROL),
        add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", kind != "gpt2")),
        special_tokens={"bos_token": _token_text(tokens, bos) or "", "eos_token": _token_text(tokens, eos) or ""},
    )


def _added_token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _hf_chat_template(directory: Path, tok_cfg: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json's `chat_template`, else tokenizer_config.json's."""
    jinja_file, json_file = directory / "chat_template.jinja", directory / "chat_template.json"
    if jinja_file.is_file():
        return jinja_file.read_text() or None
    if json_file.is_file():
        processor = _read_json(json_file)
        template = chosen_template(processor.get("chat_template"))
        if template is not None:
            return template
    return chosen_template(tok_cfg.get("chat_template"))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: malformed JSON ({exc})") from exc
    return value if isinstance(value, dict) else {}


def _special_ids(backend: BackendTokenizer) -> dict[str, int]:
    """The special added tokens' text -> id."""
    return {token.content: token_id for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special}


def tokenizer_from_hf_dir(directory: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The tokenizer of an HF model directory (tokenizer.json + tokenizer_config.json). `eos_token_ids`:
    config.json's; generation_config.json's and tokenizer_config.json's eos are added (stop_tokens.py)."""
    directory = Path(directory)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"{directory}: no tokenizer.json; kvpilot needs the fast tokenizer file next to "
                             "config.json (save it with tokenizer.save_pretrained)")
    backend = BackendTokenizer.from_file(str(tokenizer_file))
    config_file = directory / "tokenizer_config.json"
    tok_cfg = _read_json(config_file) if config_file.is_file() else {}
    bos_text = _added_token_text(tok_cfg.get("bos_token"))
    eos_text = _added_token_text(tok_cfg.get("eos_token"))
    bos_id = backend.token_to_id(bos_text) if bos_text else None
    generation_eos = generation_config_eos(directory)
    # without generation_config.json, the known end-of-turn tokens stand in for its list
    turn_ends = end_of_turn_ids(_special_ids(backend)) if generation_eos is None else []
    eos_ids = merged(eos_token_ids, generation_eos or [], [backend.token_to_id(eos_text) if eos_text else None],
                     turn_ends)
    return Tokenizer(
        backend=backend,
        chat_template=_hf_chat_template(directory, tok_cfg),
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        add_bos=False,  # tokenizer.json's post-processor already adds BOS where the model wants it
        special_tokens={"bos_token": bos_text or "", "eos_token": eos_text or ""},
    )
