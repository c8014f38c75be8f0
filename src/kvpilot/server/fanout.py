"""n > 1, best_of and batched prompts: one HTTP request fanned out into several engine requests, as vLLM V1's
front end does (the engine itself only ever runs single-sequence requests).

Numbering. A request with P prompts and m candidates per prompt (m = best_of if set, else n) becomes P * m
sub-requests; sub-request k serves prompt i = k // m and candidate j = k % m (prompt-major).

* Ids: a lone sub-request keeps the request's id (`cmpl-<id>`); several are `<id>-<k>`.
* Seeds: candidate j of a seeded request samples with (seed + j) mod 2**64 (vLLM's rule), so the n choices of
  one prompt differ while each stays reproducible, a request with n = 1 keeps its seed, and every prompt of a
  batch uses the same seeds as it would alone.
* Choices: without ranking (best_of unset or equal to n) choice k is sub-request k, i.e. index i * n + j (the
  order OpenAI and vLLM use for batches). With best_of > n, each prompt's n candidates with the highest
  cumulative logprob (the sum of the sampled tokens' logprobs, as the sampler computed them from the processed
  logits) are returned, best first, ties in candidate order: index i * n + rank.
* Usage: prompt tokens once per prompt; completion tokens of every sub-request (best_of's dropped candidates
  too: they were generated, and OpenAI bills them); cached tokens per prompt: the most any of its sub-requests
  found in the prefix cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any, Sequence

from kvpilot.outputs import RequestOutput
from kvpilot.server.openai.errors import APIError

SEED_MODULUS = 2**64  # SamplingParams' seed range is 0..2**64-1: seed + j wraps around inside it
MAX_SUB_REQUESTS = 1024  # prompts x candidates of one request, when no queue cap is lower


@dataclass(frozen=True)
class FanoutShape:
    """How one request splits. Invariants: num_prompts >= 1 and 1 <= n <= candidates (checked by the request
    model before this is built)."""

    num_prompts: int
    n: int
    candidates: int

    @property
    def size(self) -> int:
        """Number of sub-requests (engine requests)."""
        return self.num_prompts * self.candidates

    @property
    def num_choices(self) -> int:
        return self.num_prompts * self.n

    @property
    def ranked(self) -> bool:
        """best_of > n: candidates are ranked by cumulative logprob, so every one needs its logprobs."""
        return self.candidates > self.n

    def prompt_of(self, k: int) -> int:
        return k // self.candidates

    def candidate_of(self, k: int) -> int:
        return k % self.candidates

    def is_leader(self, k: int) -> bool:
        """Candidate 0 of its prompt: the sub-request that computes the prompt for the others."""
        return self.candidate_of(k) == 0

    def followers(self, k: int) -> range:
        """The other candidates of leader k's prompt."""
        return range(k + 1, k + self.candidates)

    def sub_request_id(self, request_id: str, k: int) -> str:
        return request_id if self.size == 1 else f"{request_id}-{k}"


def id_in_use(request_id: str, live_ids: Iterable[str]) -> bool:
    """True when `request_id` is one of `live_ids` or the request id of one of them (`<request_id>-<k>`, a
    sub-request): a request with that id, fanned out or not, has not finished, so its ids would clash."""
    for live in live_ids:
        if live == request_id:
            return True
        root, _, k = live.rpartition("-")
        if root == request_id and k.isdigit():
            return True
    return False


def check_size(shape: FanoutShape, max_num_queued_reqs: int | None) -> None:
    """400 (param `n`, or `best_of` when it sets the count) when the request could never be admitted: each
    sub-request takes its own queue slot, so more of them than --max-num-queued-reqs would get a 429 forever."""
    limit = MAX_SUB_REQUESTS if max_num_queued_reqs is None else min(MAX_SUB_REQUESTS, max_num_queued_reqs)
    if shape.size > limit:
        param = "best_of" if shape.ranked else "n"
        raise APIError(400, f"{param}: this request needs {shape.size} engine requests ({shape.num_prompts} "
                            f"prompt(s) x {shape.candidates} candidate(s) each), more than the {limit} one request "
                            "may queue (--max-num-queued-reqs, at most "
                            f"{MAX_SUB_REQUESTS}): lower {param} or send fewer prompts per request", param=param)


def sub_seed(seed: int | None, candidate: int) -> int | None:
    """The seed of candidate `candidate` (see the module docstring): None stays None."""
    return None if seed is None else (seed + candidate) % SEED_MODULUS


def cumulative_logprob(output: RequestOutput) -> float:
    """Sum of the sampled tokens' logprobs; a NaN counts as -inf (ranked last), no logprobs as 0."""
    total = 0.0
    for entry in output.outputs[0].logprobs or ():
        total += entry.logprob if not math.isnan(entry.logprob) else -math.inf
    return total


def choose(shape: FanoutShape, finals: Sequence[RequestOutput]) -> list[tuple[int, int]]:
    """(choice index, sub-request k) for every returned choice, in choice order (see the module docstring).
    `finals`: every sub-request's final output, in k order."""
    if not shape.ranked:
        return [(k, k) for k in range(shape.size)]
    chosen: list[tuple[int, int]] = []
    for i in range(shape.num_prompts):
        first = i * shape.candidates
        ranking = sorted(range(first, first + shape.candidates), key=lambda k: -cumulative_logprob(finals[k]))
        chosen.extend((i * shape.n + rank, k) for rank, k in enumerate(ranking[:shape.n]))
    return chosen


@dataclass(frozen=True)
class UsageTotals:
    """Token counts of a fanned-out request (see the module docstring). Invariant: cached <= prompt."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def usage_totals(shape: FanoutShape, finals: Sequence[RequestOutput]) -> UsageTotals:
    prompt = cached = 0
    for i in range(shape.num_prompts):
        group = finals[i * shape.candidates:(i + 1) * shape.candidates]
        prompt += len(group[0].prompt_token_ids)
        cached += max(o.num_cached_tokens for o in group)
    completion = sum(len(o.outputs[0].token_ids) for o in finals)
    return UsageTotals(prompt, completion, cached)


def sub_request_summary(finals: Sequence[RequestOutput]) -> list[dict[str, Any]]:
    """Per sub-request facts for the `kvpilot` field of a fanned-out response: its prefix-cache hit shows there."""
    summary = []
    for output in finals:
        metrics = output.metrics
        summary.append({"request_id": output.request_id, "prompt_tokens": len(output.prompt_token_ids),
                        "cached_tokens": output.num_cached_tokens,
                        "completion_tokens": len(output.outputs[0].token_ids),
                        "num_preemptions": getattr(metrics, "num_preemptions", 0),
                        "finish_reason": output.outputs[0].finish_reason})
    return summary
