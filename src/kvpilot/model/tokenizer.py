"""Tokenizer: encode/decode and chat templates, built from GGUF metadata or an HF model directory.

Built on the `tokenizers` library. GGUF files with a gpt2-style BPE vocabulary are converted directly
(fast); other GGUF vocabularies go through transformers' converter.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers

from kvpilot.fit.gguf_metadata import field_value
from kvpilot.model.chat_template import render_chat
from kvpilot.model.errors import ModelLoadError

GGUF_TOKEN_TYPE_CONTROL = 3


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
                            tools: list[dict[str, Any]] | None = None) -> str:
        return render_chat(self.chat_template, messages, add_generation_prompt, tools, **self.special_tokens)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the chat-templated prompt (the template writes BOS itself where the model wants it)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _gguf_bpe_backend(reader: Any, tokens: list[str]) -> BackendTokenizer:
    merges = field_value(reader, "tokenizer.ggml.merges") or []
    token_types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    control = [tokens[i] for i, kind in enumerate(token_types) if kind == GGUF_TOKEN_TYPE_CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
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
    backend = _gguf_bpe_backend(reader, tokens) if kind == "gpt2" else _gguf_converted_backend(path)
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    return Tokenizer(
        backend=backend,
        chat_template=field_value(reader, "tokenizer.chat_template"),
        bos_token_id=bos,
        eos_token_ids=(int(eos),) if eos is not None else (),
        add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", kind != "gpt2")),
        special_tokens={"bos_token": _token_text(tokens, bos) or "", "eos_token": _token_text(tokens, eos) or ""},
    )


def _added_token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_from_hf_dir(directory: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The tokenizer of an HF model directory (tokenizer.json + tokenizer_config.json)."""
    directory = Path(directory)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"{directory}: no tokenizer.json; kvpilot needs the fast tokenizer file next to "
                             "config.json (save it with tokenizer.save_pretrained)")
    backend = BackendTokenizer.from_file(str(tokenizer_file))
    config_file = directory / "tokenizer_config.json"
    tok_cfg = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = tok_cfg.get("chat_template")
    jinja_file = directory / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    bos_text = _added_token_text(tok_cfg.get("bos_token"))
    eos_text = _added_token_text(tok_cfg.get("eos_token"))
    bos_id = backend.token_to_id(bos_text) if bos_text else None
    eos_from_tok = backend.token_to_id(eos_text) if eos_text else None
    eos_ids = tuple(dict.fromkeys([*eos_token_ids, *([eos_from_tok] if eos_from_tok is not None else [])]))
    return Tokenizer(
        backend=backend,
        chat_template=template,
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        add_bos=False,  # tokenizer.json's post-processor already adds BOS where the model wants it
        special_tokens={"bos_token": bos_text or "", "eos_token": eos_text or ""},
    )
