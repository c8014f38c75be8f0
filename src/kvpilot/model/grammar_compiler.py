"""GrammarCompiler: the runner's llguidance matchers, compiled once per spec under GrammarLimits."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

from kvpilot.structured_outputs import StructuredOutputsParams
from kvpilot.structured_outputs.limits import GRAMMAR_LIMITS, GrammarLimits
from kvpilot.structured_outputs.matchers import compile_matcher, ll_tokenizer

MAX_CACHED_GRAMMARS = 128


class GrammarCompiler:
    """llguidance's tokenizer view (built once, on first use: ~0.2 s) and compiled grammars, cached by spec:
    a new request gets a copy of the cached pristine matcher (microseconds). Used by the engine's thread only
    (the pristine matchers never leave it; their copies do)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 limits: GrammarLimits = GRAMMAR_LIMITS) -> None:
        self._tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.limits = limits
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher at the start of the spec's grammar; StructuredOutputsError (bounded, naming the
        limit) if it cannot be built."""
        key = spec.cache_key()
        pristine = self._cache.get(key)
        if pristine is None:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer(self._tokenizer, self.vocab_size, self.eos_token_ids)
            pristine = compile_matcher(self._ll_tokenizer, spec, self.limits)
            self._cache[key] = pristine
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return pristine.deep_copy()
