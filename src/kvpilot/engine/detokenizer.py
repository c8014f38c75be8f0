"""Incremental detokenization with stop strings: streaming-safe text deltas.

Text is decoded by the tokenizer's own stream decoder where it has one (kvpilot's Tokenizer: tokenizers'
DecodeStream), else over a small sliding window of tokens (so BPE merges across token boundaries and
multi-byte UTF-8 characters split over tokens come out right), and a delta is released only once it is
complete: never a half character (U+FFFD) and never the beginning of a stop string that may still complete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 6  # tokens of left context re-decoded with each new token


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer. One that also has `decode_stream(skip_special_tokens)` (a
    factory of per-sequence incremental decoders: id in, completed text or None out, e.g. kvpilot's Tokenizer;
    the factory may return None) is decoded through it, one call a token, instead of re-decoding a window."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class IncrementalDetokenizer:
    """Feed generated token ids one step at a time; read `text` (final) and the deltas returned by `push`.

    Invariants: `text` never contains a stop string nor anything after one; the concatenation of all
    returned deltas equals `text` once `finish()` has been called.
    """

    decoder: Decoder
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # all text decoded so far (stop-truncated once a stop string matched)
    stop_reason: str | None = None
    _prefix_offset: int = 0
    _read_offset: int = 0
    _emitted: int = 0  # characters of `text` already returned as deltas
    _stream: Callable[[int], str | None] | None = None  # the decoder's decode_stream, where it has one

    def __post_init__(self) -> None:
        factory = getattr(self.decoder, "decode_stream", None)
        self._stream = factory(self.skip_special_tokens) if factory is not None else None

    def push(self, new_token_ids: list[int]) -> str:
        """Adds tokens; returns the newly safe text delta ('' if it must wait). Sets stop_reason on a match;
        tokens pushed after a stop matched are ignored (the text has ended)."""
        if self.stop_reason is not None:
            return ""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            if self._stream is None or not self._stream_next(token_id):
                self._decode_next()
            if self._check_stop():
                break
        return self._release(final=self.stop_reason is not None)

    def finish(self) -> str:
        """Returns whatever text was held back (the request has ended)."""
        return self._release(final=True)

    def _stream_next(self, token_id: int) -> bool:
        """The stream decoder's text for the new token; False when it raised (tokenizers' DecodeStream refuses
        some vocabularies' byte sequences: InvalidPrefix): the window takes over from the last token the stream
        released text for, so no text is lost or repeated."""
        try:
            chunk = self._stream(token_id)  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - any failure of the native decoder: the window decodes instead
            self._stream = None
            self._prefix_offset = max(self._read_offset - CONTEXT_TOKENS, 0)
            return False
        if chunk:
            self.text += chunk
            self._read_offset = len(self.token_ids)
        return True

    def _decode_next(self) -> None:
        prefix = self.decoder.decode(self.token_ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full = self.decoder.decode(self.token_ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self.text += full[len(prefix):]
            self._read_offset = len(self.token_ids)
            self._prefix_offset = max(self._read_offset - CONTEXT_TOKENS, 0)

    def _check_stop(self) -> bool:
        if not self.stop:  # most requests: nothing to look for (this runs for every token)
            return False
        # Only the tail can hold a new match: look back by the longest stop string.
        window = max(len(s) for s in self.stop)
        start = max(self._emitted, len(self.text) - window - 1) if window else len(self.text)
        for stop in self.stop:
            index = self.text.find(stop, max(start - len(stop), 0))
            if index != -1:
                self.text = self.text[:index]
                self.stop_reason = stop
                return True
        return False

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.stop:
            end = max(self._emitted, end - (max(len(s) for s in self.stop) - 1))
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
