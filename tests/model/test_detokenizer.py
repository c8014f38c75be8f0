"""Incremental detokenization: deltas add up to the full text, multi-byte characters split across tokens are
never emitted half-done, and stop strings never reach the output; through the tokenizer's stream decoder and
through the detokenizer's own window, token for token the same."""

from __future__ import annotations

import pytest

from kvpilot.engine.detokenizer import IncrementalDetokenizer
from kvpilot.fit.gguf_metadata import open_gguf
from kvpilot.model.tokenizer import tokenizer_from_gguf

TEXT = "Grüße aus Köln! 日本語のテキスト 😀🎉 and plain ASCII at the end."


class WindowDecoder:
    """Only decode(): the detokenizer's own windowed re-decoding (a tokenizer without decode_stream)."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


@pytest.fixture(scope="module", params=["stream", "window"])
def tokenizer(request, gguf_path):
    """kvpilot's Tokenizer (tokenizers' DecodeStream) and the same one seen as a plain decoder."""
    tokenizer = tokenizer_from_gguf(open_gguf(gguf_path), gguf_path)
    if request.param == "stream":
        return tokenizer
    window = WindowDecoder(tokenizer)
    window.encode = tokenizer.encode
    return window


def test_the_stream_and_the_window_give_the_same_deltas(gguf_path):
    tokenizer = tokenizer_from_gguf(open_gguf(gguf_path), gguf_path)
    ids = tokenizer.encode(TEXT + " <|im_end|> tail")
    stream, window = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(WindowDecoder(tokenizer))
    assert stream._stream is not None and window._stream is None
    assert [stream.push([t]) for t in ids] == [window.push([t]) for t in ids]
    assert stream.text == window.text == tokenizer.decode(ids)


def test_deltas_concatenate_to_text_without_broken_characters(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # multi-byte characters really are split over several tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([token]) for token in ids] + [detok.finish()]
    assert "".join(deltas) == TEXT == detok.text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    ids = tokenizer.encode("The answer is 42. STOP here and more text")
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    deltas = []
    for token in ids:
        deltas.append(detok.push([token]))
        if detok.stop_reason:
            break
    deltas.append(detok.finish())
    assert detok.stop_reason == "STOP"
    assert detok.text == "The answer is 42. "
    assert "".join(deltas) == detok.text
    assert not any("S" in d for d in deltas)


def test_stop_string_spanning_tokens(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tokenizer, stop=["ta gam"])
    streamed = "".join(detok.push([t]) for t in ids) + detok.finish()
    assert detok.text == "alpha be" and streamed == "alpha be"


class FailingStream:
    """The real tokenizer, whose stream decoder raises at its twelfth token (as DecodeStream's InvalidPrefix can)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids, skip_special_tokens=True):
        return self.tokenizer.decode(token_ids, skip_special_tokens)

    def decode_stream(self, skip_special_tokens=True):
        inner, seen = self.tokenizer.decode_stream(skip_special_tokens), []

        def step(token_id):
            seen.append(token_id)
            if len(seen) == 12:
                raise ValueError("InvalidPrefix")
            return inner(token_id)
        return step


def test_a_failing_stream_hands_over_to_the_window_without_losing_text(gguf_path):
    """TEXT's tokens 10-12 (from 0) are the bytes of " 日": the stream holds token 10 back and fails at 11, so
    the window must start from token 10, the first whose text was not released."""
    tokenizer = tokenizer_from_gguf(open_gguf(gguf_path), gguf_path)
    ids = tokenizer.encode(TEXT)
    assert "\ufffd" in tokenizer.decode(ids[10:12]) and tokenizer.decode(ids[10:13]) == " 日"
    detok = IncrementalDetokenizer(FailingStream(tokenizer))
    deltas = [detok.push([t]) for t in ids] + [detok.finish()]
    assert detok._stream is None  # it did fail
    assert "".join(deltas) == TEXT == detok.text
    assert all("\ufffd" not in d for d in deltas)
