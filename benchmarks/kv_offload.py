"""KV offload (issue #49) side by side in one run: multi-turn sessions whose contexts together need ~4x the KV pool,
on two engines over the same weights and the same pool, one with a host offload tier (--kv-offloading-size),
one without. Prints the TTFT p50 of returning turns (every turn after a session's first) of each and their
ratio (goal: recompute / offload >= 3x), median over passes with the spread, the tier hits, and whether every
greedy output was token-identical.

    .venv/bin/python benchmarks/kv_offload.py                 # 5 passes, 8 sessions x 4 turns (a few minutes)
    .venv/bin/python benchmarks/kv_offload.py --smoke         # 1 short pass: does it run
    .venv/bin/python benchmarks/kv_offload.py --sessions 12 --turns 5 --passes 7

A pass builds both engines fresh (cold caches), then runs the same conversation on each, alternating between
passes which goes first (so a drifting machine favours neither). Sessions take turns round-robin, one request
at a time, so by the time a session returns the others have pushed its blocks out of the pool: without offload
its whole context is recomputed, with offload its full blocks are copied back from the tier. A turn's prompt is
the session's previous prompt, its answer and a new user message (token ids drawn from a seeded generator:
timing does not depend on the text). One request at a time: a returning turn's loads run before its own step
(nothing runs beside it to overlap them with; benchmarks/kv_offload_overlap.py measures that case).
Record results in docs/benchmark-log.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

from kvpilot import LLM, SamplingParams

GOAL = 3.0


@dataclass(frozen=True)
class Shape:
    """The workload: sessions x turns, the first prompt's and each new user message's tokens, the answer's."""

    sessions: int
    turns: int
    first_tokens: int
    user_tokens: int
    answer_tokens: int
    pool_ratio: float  # the sessions' final contexts / the pool

    @property
    def context_tokens(self) -> int:
        """A session's longest prompt: its last turn's."""
        return self.first_tokens + (self.turns - 1) * (self.answer_tokens + self.user_tokens)

    def pool_tokens(self, block_size: int) -> int:
        tokens = int(self.sessions * (self.context_tokens + self.answer_tokens) / self.pool_ratio)
        longest = self.context_tokens + self.answer_tokens + block_size
        return max(tokens, longest)  # one request must still fit alone


@dataclass(frozen=True)
class PassResult:
    """One engine's run of the conversation: TTFT (s) of each returning turn, every answer, tier hits (tokens)."""

    returning_ttfts: list[float]
    answers: list[list[int]]
    tier_hit_tokens: int
    cached_tokens: int

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.returning_ttfts)


def _engine(base: LLM, shape: Shape, offload_bytes: int | None, block_size: int) -> LLM:
    """An engine over base's weights with a pool of shape.pool_tokens (and a host tier of offload_bytes)."""
    pool = shape.pool_tokens(block_size)
    kwargs: dict = dict(kv_cache_memory=(pool + block_size) * _bytes_per_token(base), max_model_len=pool,
                        max_num_seqs=4, block_size=block_size)
    if offload_bytes is not None:
        kwargs["kv_offloading_size"] = f"{offload_bytes}B"
    return LLM(loaded=base.loaded, **kwargs)


def _bytes_per_token(llm: LLM) -> int:
    import torch

    config = llm.loaded.config
    element = torch.tensor([], dtype=llm.loaded.dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element


def run_conversation(llm: LLM, shape: Shape, seed: int) -> PassResult:
    rng = random.Random(seed)
    vocab = llm.loaded.config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, min(vocab, 30000)) for _ in range(n)]

    params = SamplingParams(temperature=0.0, max_tokens=shape.answer_tokens, ignore_eos=True)
    prompts = [tokens(shape.first_tokens) for _ in range(shape.sessions)]
    ttfts, answers, tier, cached = [], [], 0, 0
    for turn in range(shape.turns):
        for s in range(shape.sessions):
            output = llm.generate([prompts[s]], params)[0]
            answer = list(output.outputs[0].token_ids)
            answers.append(answer)
            if turn:
                ttfts.append(output.metrics.ttft)
                tier += output.metrics.num_tier_cached_tokens
                cached += output.num_cached_tokens
            prompts[s] = prompts[s] + answer + tokens(shape.user_tokens)
    return PassResult(ttfts, answers, tier, cached)


def run_pass(base: LLM, shape: Shape, offload_bytes: int, block_size: int, index: int
             ) -> tuple[PassResult, PassResult]:
    """(offload off, offload on), run in alternating order, each on a fresh engine."""
    order = [False, True] if index % 2 == 0 else [True, False]
    results: dict[bool, PassResult] = {}
    for on in order:
        llm = _engine(base, shape, offload_bytes if on else None, block_size)
        results[on] = run_conversation(llm, shape, seed=1000 + index)
        del llm
    return results[False], results[True]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one short pass (seconds): does it run")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-tokens", type=int, default=320)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--pool-ratio", type=float, default=4.0, help="the sessions' contexts / the KV pool")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    shape = Shape(args.sessions, args.turns, args.first_tokens, args.user_tokens, args.answer_tokens,
                  args.pool_ratio)
    passes = args.passes
    if args.smoke:
        shape, passes = Shape(3, 2, 48, 8, 4, 3.0), 1
    # the engines reuse these weights; its max_model_len sizes the rotary tables their longest request needs
    base = LLM(model=args.model, dtype=args.dtype, kv_cache_memory="64MiB",
               max_model_len=shape.pool_tokens(args.block_size), max_num_seqs=1)
    # a tier that holds every session's whole context, twice over
    offload_bytes = 2 * shape.sessions * (shape.context_tokens + shape.answer_tokens) * _bytes_per_token(base)
    print(f"{shape.sessions} sessions x {shape.turns} turns, contexts up to {shape.context_tokens} tokens, "
          f"a pool of {shape.pool_tokens(args.block_size)} tokens ({shape.pool_ratio:g}x less than the sessions "
          f"need), host tier {offload_bytes / 2**20:.1f} MiB; {passes} pass(es)")
    ratios, identical = [], True
    for i in range(passes):
        off, on = run_pass(base, shape, offload_bytes, args.block_size, i)
        identical &= off.answers == on.answers
        ratio = off.ttft_p50 / on.ttft_p50
        ratios.append(ratio)
        print(f"pass {i + 1}: returning-turn TTFT p50 recompute {off.ttft_p50 * 1000:.1f} ms, offload "
              f"{on.ttft_p50 * 1000:.1f} ms: {ratio:.2f}x; tier hits {on.tier_hit_tokens} tokens "
              f"(cached {on.cached_tokens} with offload, {off.cached_tokens} without)")
    median = statistics.median(ratios)
    print(f"ratio (recompute / offload TTFT p50 of returning turns): median {median:.2f}x, spread "
          f"{min(ratios):.2f}-{max(ratios):.2f}x over {passes} pass(es); goal >= {GOAL:g}x: "
          f"{'met' if median >= GOAL else 'NOT met'}; outputs identical: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
