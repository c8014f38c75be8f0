"""KV offload's overlap (issue #49) side by side in one run: streams decode while sessions return whose contexts
the pool had to evict to the host tier. Three engines: the default loads a returning turn's blocks beside the
streams' next steps, paced so that each step's copy hides behind it (`--kv-offload-overlap`; on a CPU
engine/load_pacing.py spreads a long context over several steps); "one round" loads them all beside one step (the
pacer removed: the behaviour before pacing); "no overlap" before the forward of the step that admits the turn
(`--no-kv-offload-overlap`). Prints, for each, the streams' inter-token gaps (p50, p99, max) and the returning
turns' TTFT p50, the ratios of the streams' p99 gaps (each other engine's / the default's), median over passes
with the spread, and whether every greedy output was token-identical among them (checked with `--dtype float32`:
in bf16 a returning turn admitted a step later shares its steps with other rows, and bf16 sums depend on the batch).

    .venv/bin/python benchmarks/kv_offload_overlap.py              # 5 passes (a few minutes)
    .venv/bin/python benchmarks/kv_offload_overlap.py --smoke      # 1 short pass: does it run
    .venv/bin/python benchmarks/kv_offload_overlap.py --disk DIR   # the contexts demoted to a disk tier

A pass builds both engines fresh, alternating which goes first. Each engine first runs every session's first
turn alone (each evicts the ones before it into the tier), then starts the streams and, every
`--return-every` steps, one session's second turn (its first turn's prompt and answer, then a new user
message): its full blocks come back from the tier. Token ids come from a seeded generator (timing does not
depend on the text). Record results in docs/benchmark-log.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field

from kv_offload import _bytes_per_token  # benchmarks/ is the script's folder

from kvpilot import LLM, SamplingParams


@dataclass(frozen=True)
class Shape:
    sessions: int
    context_tokens: int  # a session's first prompt
    user_tokens: int
    answer_tokens: int
    streams: int
    return_every: int  # engine steps between two returning turns

    @property
    def stream_tokens(self) -> int:
        """Long enough that the streams decode through every return."""
        return self.return_every * (self.sessions + 2)

    @property
    def pool_tokens(self) -> int:
        """One returning turn and the streams fit; two contexts do not (each first turn evicts the last)."""
        return self.context_tokens + 2 * (self.user_tokens + self.answer_tokens) + \
            self.streams * (16 + self.stream_tokens) + 64


@dataclass
class Run:
    """One engine's run: the streams' gaps between tokens (s), returning turns' TTFTs (s), every answer."""

    gaps: list[float] = field(default_factory=list)
    return_ttfts: list[float] = field(default_factory=list)
    answers: dict[str, list[int]] = field(default_factory=dict)
    overlapped_blocks: int = 0
    loaded_blocks: int = 0

    def gap_ms(self, q: float) -> float:
        ordered = sorted(self.gaps)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


MODES = ("paced", "one round", "no overlap")


def _engine(base: LLM, shape: Shape, mode: str, disk: str | None) -> LLM:
    per_token = _bytes_per_token(base)
    tier_tokens = 2 * shape.sessions * (shape.context_tokens + shape.answer_tokens + shape.user_tokens)
    tiers: dict = dict(kv_offloading_size=f"{tier_tokens * per_token}B")
    if disk is not None:  # a host tier of a few blocks: the contexts are demoted on to disk
        tiers = dict(kv_offloading_size=f"{64 * 16 * per_token}B", kv_offload_dir=disk,
                     kv_offload_dir_size=f"{tier_tokens * per_token}B")
    llm = LLM(loaded=base.loaded, kv_cache_memory=(shape.pool_tokens + 32) * per_token,
              max_model_len=shape.pool_tokens, max_num_seqs=shape.streams + 2,
              kv_offload_overlap=mode != "no overlap", **tiers)
    if mode == "one round":
        llm.engine.scheduler.kv.pacer = None  # every tier block of a turn beside one step
    return llm


def run_engine(llm: LLM, shape: Shape, seed: int) -> Run:
    rng = random.Random(seed)
    vocab = min(llm.loaded.config.vocab_size, 30000)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    answer = SamplingParams(temperature=0.0, max_tokens=shape.answer_tokens, ignore_eos=True)
    firsts = [tokens(shape.context_tokens) for _ in range(shape.sessions)]
    seconds = []
    for prompt in firsts:  # each first turn evicts the contexts before it into the tier
        output = llm.generate([prompt], answer)[0]
        seconds.append(prompt + list(output.outputs[0].token_ids) + tokens(shape.user_tokens))
    engine, run = llm.engine, Run()
    stream = SamplingParams(temperature=0.0, max_tokens=shape.stream_tokens, ignore_eos=True)
    stream_ids = [engine.add_request(tokens(16), stream, request_id=f"stream{i}") for i in range(shape.streams)]
    last_token: dict[str, float] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step % shape.return_every == shape.return_every // 2 and step // shape.return_every < shape.sessions:
            engine.add_request(seconds[step // shape.return_every], answer,
                               request_id=f"return{step // shape.return_every}")
        outputs = engine.step()
        now = time.perf_counter()
        step += 1
        for output in outputs:
            rid = output.request_id
            if rid in stream_ids and output.outputs[0].token_ids:
                if rid in last_token:
                    run.gaps.append(now - last_token[rid])
                last_token[rid] = now
            if output.finished:
                run.answers[rid] = list(output.outputs[0].token_ids)
                if rid.startswith("return"):
                    run.return_ttfts.append(output.metrics.ttft)
    stats = engine.scheduler.make_stats()
    run.overlapped_blocks, run.loaded_blocks = stats.num_offload_overlapped_blocks, \
        stats.num_offload_loaded_blocks + stats.num_offload_disk_loaded_blocks
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one short pass (seconds): does it run")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--context-tokens", type=int, default=3000)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--return-every", type=int, default=12)
    parser.add_argument("--disk", default=None, help="a folder for a disk tier below a small host tier")
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    shape = Shape(args.sessions, args.context_tokens, 32, 16, args.streams, args.return_every)
    passes = args.passes
    if args.smoke:
        shape, passes = Shape(2, 256, 8, 4, 2, 6), 1
    base = LLM(model=args.model, dtype=args.dtype, kv_cache_memory="512MiB", max_model_len=shape.pool_tokens,
               max_num_seqs=1)
    print(f"{shape.sessions} sessions of {shape.context_tokens} tokens returning among {shape.streams} streams "
          f"(one every {shape.return_every} steps), a pool of {shape.pool_tokens} tokens, "
          f"{'disk' if args.disk else 'host'} tier; {passes} pass(es)")
    ratios: dict[str, list[float]] = {mode: [] for mode in MODES[1:]}
    identical = True
    for i in range(passes):
        runs: dict[str, Run] = {}
        for mode in MODES[i % 3:] + MODES[:i % 3]:  # each engine goes first in turn
            runs[mode] = run_engine(_engine(base, shape, mode, args.disk), shape, seed=2000 + i)
        identical &= all(runs[mode].answers == runs["paced"].answers for mode in MODES[1:])
        for mode in MODES:
            run = runs[mode]
            print(f"pass {i + 1} {mode:10}: stream gaps p50 {run.gap_ms(0.5):.1f} p99 {run.gap_ms(0.99):.1f} max "
                  f"{max(run.gaps) * 1000:.1f} ms; returning TTFT p50 {statistics.median(run.return_ttfts) * 1000:.1f}"
                  f" ms; {run.loaded_blocks} blocks loaded, {run.overlapped_blocks} beside a step")
        for mode in MODES[1:]:
            ratios[mode].append(runs[mode].gap_ms(0.99) / runs["paced"].gap_ms(0.99))
        print(f"pass {i + 1}: stream gap p99 / paced's: " + ", ".join(f"{m} {ratios[m][-1]:.2f}x" for m in MODES[1:]))
    for mode in MODES[1:]:
        print(f"stream gap p99, {mode} / paced: median {statistics.median(ratios[mode]):.2f}x, spread "
              f"{min(ratios[mode]):.2f}-{max(ratios[mode]):.2f}x over {passes} pass(es)")
    print(f"outputs identical: {identical}" + ("" if args.dtype == "float32" else
                                               " (exact only in float32: --dtype float32)"))
    return 0 if identical or args.dtype != "float32" else 1


if __name__ == "__main__":
    raise SystemExit(main())
