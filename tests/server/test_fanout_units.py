"""fanout.py's rules on plain outputs: numbering, the seed rule, best_of's ranking, usage totals, the size cap."""

from __future__ import annotations

import math

import pytest

from kvpilot.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvpilot.server.openai.errors import APIError
from kvpilot.server.fanout import (MAX_SUB_REQUESTS, FanoutShape, check_size, choose, cumulative_logprob, sub_seed,
                                   usage_totals)


def _final(k: int, logprobs: list[float], prompt_len: int = 5, cached: int = 0) -> RequestOutput:
    entries = [TokenLogprob(1, lp, []) for lp in logprobs]
    return RequestOutput(f"r-{k}", None, [1] * prompt_len,
                         [CompletionOutput(0, "x" * len(logprobs), [1] * len(logprobs), "length", None, entries)],
                         finished=True, num_cached_tokens=cached)


def test_numbering_is_prompt_major() -> None:
    shape = FanoutShape(num_prompts=2, n=2, candidates=3)
    assert shape.size == 6 and shape.num_choices == 4 and shape.ranked
    assert [(shape.prompt_of(k), shape.candidate_of(k)) for k in range(6)] == \
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [k for k in range(6) if shape.is_leader(k)] == [0, 3] and list(shape.followers(3)) == [4, 5]
    assert shape.sub_request_id("cmpl-a", 4) == "cmpl-a-4"
    assert FanoutShape(1, 1, 1).sub_request_id("cmpl-a", 0) == "cmpl-a"  # a lone request keeps its id


def test_seed_rule() -> None:
    assert [sub_seed(7, j) for j in range(3)] == [7, 8, 9]
    assert sub_seed(2**64 - 1, 1) == 0  # wraps inside SamplingParams' seed range
    assert sub_seed(None, 2) is None


def test_unranked_choices_are_the_sub_requests_in_order() -> None:
    shape = FanoutShape(2, 2, 2)
    assert choose(shape, [_final(k, [-1.0]) for k in range(4)]) == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_best_of_keeps_each_prompts_best_by_cumulative_logprob() -> None:
    shape = FanoutShape(num_prompts=2, n=2, candidates=3)
    finals = [_final(0, [-1.0, -1.0]), _final(1, [-0.5]), _final(2, [-3.0]),  # prompt 0: sums -2, -0.5, -3
              _final(3, [-1.0]), _final(4, [-1.0]), _final(5, [float("nan")])]  # prompt 1: a tie, then NaN
    assert choose(shape, finals) == [(0, 1), (1, 0), (2, 3), (3, 4)]  # best first; ties in candidate order
    assert cumulative_logprob(finals[5]) == -math.inf


def test_usage_counts_each_prompt_once() -> None:
    shape = FanoutShape(num_prompts=2, n=1, candidates=2)
    finals = [_final(0, [-1.0] * 3, 10, 0), _final(1, [-1.0] * 2, 10, 8),
              _final(2, [-1.0], 4, 0), _final(3, [-1.0] * 4, 4, 0)]
    totals = usage_totals(shape, finals)
    assert (totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens) == (14, 10, 8)


def test_size_cap_names_the_field() -> None:
    check_size(FanoutShape(4, 2, 2), 16)
    with pytest.raises(APIError) as refused:
        check_size(FanoutShape(6, 2, 2), 10)
    assert refused.value.param == "n" and "12 engine requests" in refused.value.message
    with pytest.raises(APIError) as ranked:
        check_size(FanoutShape(1, 1, MAX_SUB_REQUESTS + 1), None)
    assert ranked.value.param == "best_of"
