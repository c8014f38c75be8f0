"""GrammarAdmission: a structured-outputs spec compiled for the model's tokenizer and walked a few tokens
before its request may reach the engine, so a grammar that would fail (or stall) inside an engine step is
refused up front with a message naming the limit.

llguidance finds some limits only while it parses: the Earley row limit (max_items_in_row: a choice of 10,000
strings) when the first token is fed, lexer fuel (nested counted repeats such as `(a{1000}){1000}`, a
megabyte-long literal) when it forces bytes, and a grammar that matches nothing (JSON schema `$ref`s that only
loop) at the first mask. So the probe compiles the grammar under GrammarLimits, then computes the mask and
feeds the shortest allowed token (short tokens keep a lexeme open, where these limits bite first),
num_probe_tokens times, each token's work within max_mask_ms of this thread's CPU time (not wall time: the
verdict must not depend on how busy the process is). A grammar that passes may still fail later in a long
output: the runner then fails that request alone (model/grammar_state.py).

Torch-free: the HTTP process runs it in its tokenizer pool's threads (llguidance drops the GIL while it
compiles and computes masks), never on the event loop.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from kvpilot.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from kvpilot.structured_outputs.limits import GRAMMAR_LIMITS, GrammarLimits, explain, over_budget
from kvpilot.structured_outputs.matchers import compile_matcher, ll_tokenizer

MAX_CACHED_VERDICTS = 1024


class GrammarAdmission:
    """Admits or refuses specs for one model's tokenizer (None: no model tokenizer, then only the checks that
    need none; the engine refuses structured outputs without one). Thread-safe; verdicts are cached by spec
    (the least recently used dropped past MAX_CACHED_VERDICTS), the tokenizer view built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 limits: GrammarLimits = GRAMMAR_LIMITS) -> None:
        self.limits = limits
        self._tokenizer, self._vocab_size, self._eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self._view: Any = None
        self._token_lengths: np.ndarray | None = None  # bytes per token id (0: EOS, never chosen)
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[tuple[str, str], str] = OrderedDict()  # spec key -> '' or why refused

    def warm(self) -> None:
        """Builds the tokenizer view and the token lengths now (~0.3 s holding the GIL for a 49k vocabulary),
        so that the first probe does not stall the HTTP process's event loop."""
        if self._tokenizer is not None:
            self._lengths()

    def admit(self, spec: StructuredOutputsParams) -> None:
        """Returns if `spec` may run; StructuredOutputsError (naming the limit) if not."""
        if self._tokenizer is None:  # the checks that need none
            spec.check(self.limits)
            return
        spec.check_size(self.limits)  # before compiling it (the probe compiles it for the tokenizer)
        key = spec.cache_key()
        with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                self._verdicts.move_to_end(key)
        if verdict is None:
            verdict = self._probe(spec)
            with self._lock:
                self._verdicts[key] = verdict
                if len(self._verdicts) > MAX_CACHED_VERDICTS:
                    self._verdicts.popitem(last=False)
        if verdict:
            raise StructuredOutputsError(verdict)

    def _probe(self, spec: StructuredOutputsParams) -> str:
        """'' if the grammar compiles for the tokenizer and takes num_probe_tokens tokens within the limits."""
        from llguidance.numpy import fill_next_token_bitmask

        try:
            matcher = compile_matcher(self._ll_tokenizer(), spec, self.limits)
        except StructuredOutputsError as exc:
            return str(exc)
        lengths = self._lengths()
        mask = np.zeros((1, (self._vocab_size + 31) // 32), dtype=np.int32)
        token: int | None = None
        slowest = 0.0
        for _ in range(self.limits.num_probe_tokens + 1):
            started = time.thread_time()
            if token is not None and not matcher.consume_token(token):
                break
            if slowest > self.limits.max_mask_s:  # a limit the slow token's successor hits is the better reason
                break
            fill_next_token_bitmask(matcher, mask, 0)
            slowest = max(slowest, time.thread_time() - started)
            if matcher.is_error():
                break
            token = _shortest_allowed(mask[0], lengths)
            if token is None:  # only EOS (or nothing) is allowed: the grammar is complete here
                break
        if matcher.is_error():
            return f"structured_outputs.{spec.kind}: {explain(matcher.get_error(), self.limits)}"
        if slowest > self.limits.max_mask_s:
            return f"structured_outputs.{spec.kind}: {over_budget(slowest, self.limits)}"
        return ""

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._view is None:
                self._view = ll_tokenizer(self._tokenizer, self._vocab_size, self._eos_token_ids)
            return self._view

    def _lengths(self) -> np.ndarray:
        view = self._ll_tokenizer()
        with self._lock:
            if self._token_lengths is None:
                lengths = np.fromiter((len(view.decode_bytes([t])) for t in range(self._vocab_size)),
                                      dtype=np.int64, count=self._vocab_size)
                lengths[[t for t in self._eos_token_ids if 0 <= t < self._vocab_size]] = 0
                self._token_lengths = lengths
            return self._token_lengths


def _shortest_allowed(mask: np.ndarray, lengths: np.ndarray) -> int | None:
    """The allowed token with the fewest bytes (the lowest id among those), never EOS; None if only EOS."""
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:len(lengths)].astype(bool)
    candidates = np.flatnonzero(allowed & (lengths > 0))
    if not len(candidates):
        return None
    return int(candidates[np.argmin(lengths[candidates])])
