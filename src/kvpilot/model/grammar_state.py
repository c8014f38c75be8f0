"""Grammar-constrained decoding (structured outputs) in the runner, with llguidance.

Each persistent row whose request has `structured_outputs` holds an llguidance matcher: created when the row
is added (a resumed request replays its output tokens into a fresh matcher), asked for the allowed-token
bitmask before every sample, fed the sampled token right after it. Once the grammar is complete the
matcher allows only EOS, so the request ends with finish_reason "stop" by the scheduler's one EOS rule.

Rows without a grammar cost one integer test per step. The matcher must see every token before the next
step's mask is computed, so `record` reads the constrained rows' sampled ids to the host at once: correct
under async scheduling too (where the engine reads results one step late), at the price of a device sync in
the steps that hold a constrained row. A token sampled after the grammar stopped (async scheduling computes
one past EOS, then discards it) is not fed to the matcher.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import numpy as np
import torch

from kvpilot.sampling_params import SamplingParams

MAX_CACHED_GRAMMARS = 128


class GrammarError(ValueError):
    """One request's grammar cannot run (does not compile for this tokenizer, or rejected a token): the
    engine fails that request alone (engine/step_failures.py)."""


class GrammarCompiler:
    """llguidance's tokenizer view (built once, on first use: ~0.2 s) and compiled grammars, cached by spec:
    a new request gets a copy of the cached pristine matcher (microseconds)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _tokenizer_view(self) -> Any:
        if self._ll_tokenizer is None:
            from llguidance import LLTokenizer

            backend = getattr(self._tokenizer, "backend", None)
            if backend is None or not self.eos_token_ids:
                raise GrammarError("structured outputs need the model's tokenizer (tokenizers-based) and an EOS "
                                   "token; this model has none")
            self._ll_tokenizer = LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._ll_tokenizer

    def matcher(self, params: SamplingParams) -> Any:
        """A fresh matcher at the start of the request's grammar."""
        from llguidance import LLMatcher

        spec = params.structured_outputs
        assert spec is not None
        key = spec.cache_key()
        pristine = self._cache.get(key)
        if pristine is None:
            try:
                pristine = LLMatcher(self._tokenizer_view(), spec.grammar_text(), log_level=0)
            except ValueError as exc:  # the spec could not be turned into a grammar
                raise GrammarError(str(exc)) from None
            if pristine.is_error():
                raise GrammarError(f"structured_outputs: the grammar does not compile: {pristine.get_error()}")
            self._cache[key] = pristine
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return pristine.deep_copy()


class GrammarState:
    """Per-row matchers. Invariant: matchers[r] is not None iff row r's request has structured_outputs, and
    it has consumed exactly the row's output tokens sampled so far (up to the grammar's end)."""

    def __init__(self, max_rows: int, compiler: GrammarCompiler, device: torch.device) -> None:
        self.compiler, self.device = compiler, device
        self.matchers: list[Any] = [None] * max_rows
        self.num_active = 0
        self._words = (compiler.vocab_size + 31) // 32
        self._shifts: torch.Tensor | None = None

    def add(self, row: int, params: SamplingParams, output_ids: Sequence[int]) -> None:
        self.remove(row)
        if params.structured_outputs is None:
            return
        matcher = self.compiler.matcher(params)
        if output_ids and not matcher.consume_tokens(list(output_ids)):
            raise GrammarError(f"structured_outputs: replaying the request's {len(output_ids)} output tokens "
                               f"failed: {matcher.get_error()}")
        self.matchers[row] = matcher
        self.num_active += 1

    def remove(self, row: int) -> None:
        if self.matchers[row] is not None:
            self.matchers[row] = None
            self.num_active -= 1

    def apply(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """logits [N, vocab] of persistent `rows` -> disallowed tokens of constrained rows set to -inf."""
        which = self._constrained(rows)
        if not which:
            return logits
        from llguidance.numpy import fill_next_token_bitmask

        bitmask = np.empty((len(which), self._words), dtype=np.int32)
        for k, i in enumerate(which):
            matcher = self.matchers[int(rows[i])]
            fill_next_token_bitmask(matcher, bitmask, k)
            if matcher.is_error():
                raise GrammarError(f"structured_outputs: the grammar failed: {matcher.get_error()}")
        allowed = self._unpack(torch.from_numpy(bitmask).to(logits.device), logits.shape[1])
        index = torch.tensor(which, device=logits.device)
        logits = logits.clone()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return logits

    def _constrained(self, rows: np.ndarray) -> list[int]:
        """Positions in `rows` whose row holds a matcher (none at all costs one integer test)."""
        if not self.num_active:
            return []
        return [i for i, row in enumerate(rows.tolist()) if self.matchers[row] is not None]

    def _unpack(self, bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """int32 [k, words] (bit j of word w: token 32w + j) -> bool [k, vocab_size]."""
        if self._shifts is None or self._shifts.device != bitmask.device:
            self._shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = (bitmask[:, :, None] >> self._shifts) & 1
        return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()

    def record(self, rows: np.ndarray, token_ids: torch.Tensor) -> None:
        """Feeds each constrained row its just-sampled token (reads those ids to the host)."""
        which = self._constrained(rows)
        if not which:
            return
        sampled = token_ids[torch.tensor(which, device=token_ids.device)].tolist()
        for i, token_id in zip(which, sampled):
            matcher = self.matchers[int(rows[i])]
            if matcher.is_stopped():
                continue  # past the grammar's end (EOS already taken): the token is discarded
            if not matcher.consume_token(token_id):
                raise GrammarError(f"structured_outputs: the grammar rejected sampled token {token_id}: "
                                   f"{matcher.get_error()}")
