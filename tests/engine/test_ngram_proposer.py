"""The n-gram proposer: the longest suffix match of prompt_lookup_max..min tokens, its most recent earlier
occurrence, and what followed it; checked against a brute-force reference on random token streams."""

from __future__ import annotations

import random

import numpy as np

from kvpilot.engine.ngram_proposer import NgramProposer, ngram_drafts
from tests.engine.engine_fakes import make_request


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Brute force: for n from max_n down, the latest end e < len with tokens[e-n:e] == the last n tokens."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == tokens[length - n:]:
                seq = list(tokens)
                for j in range(k):
                    seq.append(seq[end + j])
                return seq[length:]
    return []


def _drafts(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return ngram_drafts(np.array(tokens, dtype=np.int32), min_n, max_n, k)


def test_longest_match_most_recent_occurrence():
    tokens = [7, 1, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3]
    # "2 3" occurs at 2..3 (then 9) and 6..7 (then 4); "1 2 3" is the longer match only if the suffix has a 1
    assert _drafts(tokens, 1, 4, 3) == [4, 5, 2]
    # "1 2 3" (a 3-gram) ends at 4 and 8: the latest is followed by 4, then by the suffix itself
    assert _drafts([7, 1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], 1, 4, 3) == [4, 1, 2]
    assert _drafts(tokens, 3, 4, 3) == []  # no earlier "5 2 3"
    assert _drafts([5], 1, 4, 3) == [] and _drafts([1, 2], 1, 4, 0) == []


def test_a_repeating_pattern_keeps_repeating():
    assert _drafts([8, 1, 2, 1, 2, 1], 1, 3, 5) == [2, 1, 2, 1, 2]
    assert _drafts([4, 4, 4], 1, 2, 3) == [4, 4, 4]


def test_matches_brute_force_on_random_streams():
    rng = random.Random(7)
    for _ in range(400):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        assert _drafts(tokens, min_n, max_n, k) == _reference(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_the_proposer_follows_a_request_as_it_grows_and_forgets_it():
    request = make_request("a", [3, 1, 4, 1, 5], max_tokens=100)
    proposer = NgramProposer(1, 3)
    assert proposer.propose(request, 2) == []  # "5" never occurred before
    for token in [9, 2, 6, 5, 3, 5, 8, 9] * 20:  # grows past the proposer's first array
        request.append_output_token(token, 0.0)
    assert proposer.propose(request, 4) == _reference(request.all_token_ids, 1, 3, 4)
    proposer.forget("a")
    assert proposer.num_requests == 0
