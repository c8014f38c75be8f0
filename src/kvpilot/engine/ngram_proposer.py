"""The n-gram proposer (prompt lookup): drafts are what followed the most recent earlier occurrence of the
request's last tokens, in its prompt or its output. No weights, no model: text that copies (code edits,
quotes, summaries, RAG answers) is drafted right; fresh text mostly finds no match and gets no drafts.

The one engine file that uses numpy (the scheduler receives the proposer as a parameter, so the scheduler,
KV manager and their tests stay pure Python). Per request it keeps the tokens in an int32 array, extended
by the tokens appended since its last call; a lookup is a few vectorized passes over it (tens of
microseconds at 100k tokens), made only for requests the cost model lets speculate.
"""

from __future__ import annotations

import numpy as np

from kvpilot.engine.request import Request


def ngram_drafts(tokens: np.ndarray, min_n: int, max_n: int, num_drafts: int) -> list[int]:
    """Drafts for `tokens` (1-D int array): find the longest n in [min_n, max_n] such that the last n tokens
    occurred earlier (an occurrence ending before the last token; overlaps allowed), take its most recent
    occurrence, and copy the tokens that followed it. A copy that runs into the end continues with its own
    drafts (a repeating pattern keeps repeating). [] when no n >= min_n matches."""
    length = len(tokens)
    if length < 2 or num_drafts < 1:
        return []
    # ends: e such that tokens[e - n:e] == tokens[length - n:] for the current n, with e <= length - 1
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1]) + 1
    best_end, n = -1, 1
    while len(ends):
        if n >= min_n:
            best_end = int(ends[-1])  # the most recent occurrence of the longest match so far
        if n == max_n or n == length:
            break
        n += 1
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[length - n]]
    if best_end < 0:
        return []
    drafts: list[int] = []
    for j in range(num_drafts):
        position = best_end + j
        drafts.append(int(tokens[position]) if position < length else drafts[position - length])
    return drafts


class _Tokens:
    """A request's tokens as a growing int32 array (doubling: appends are amortised O(1))."""

    def __init__(self) -> None:
        self.array = np.empty(64, dtype=np.int32)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """Appends token_ids[self.length:] (tokens are only ever appended) and returns the filled view."""
        total = len(token_ids)
        if total > self.length:
            if total > len(self.array):
                grown = np.empty(max(total, 2 * len(self.array)), dtype=np.int32)
                grown[:self.length] = self.array[:self.length]
                self.array = grown
            self.array[self.length:total] = token_ids[self.length:total]
            self.length = total
        return self.array[:total]


class NgramProposer:
    """Prompt lookup over each request's prompt + output tokens (ngram_drafts); a speculator.DraftProposer.
    Invariant: holds state only for requests it was asked about and not told to forget."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._tokens: dict[str, _Tokens] = {}

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        tokens = self._tokens.get(request.request_id)
        if tokens is None:
            tokens = self._tokens[request.request_id] = _Tokens()
        return ngram_drafts(tokens.sync(request.all_token_ids), self.min_n, self.max_n, max_drafts)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._tokens)
