"""Speculative decoding (n-gram) against plain decoding on the embedded model, side by side in one run: the
same weights behind two engines, passes alternating which goes first, output tokens/s of each, their ratio
(median over passes, and its spread), drafts accepted, and whether every greedy output was token-identical.

    .venv/bin/python benchmarks/spec_decode.py                  # 5 passes of every workload (a few minutes)
    .venv/bin/python benchmarks/spec_decode.py --smoke          # 1 short pass: does it run
    .venv/bin/python benchmarks/spec_decode.py --workloads copy-c1 --passes 9
    .venv/bin/python benchmarks/spec_decode.py --draft-layers 8   # a draft model: the target's first 8 layers

Workloads (benchmarks/spec_passages.py, public-domain text), goals from issue 47:
  copy-c1   repeat / correct / re-lay a pasted passage, one request at a time    >= 1.8x plain
  chat-c1   README-style chat questions, one at a time                          >= 0.97x (never slower)
  copy-c64  the copy tasks, 64 at once (the cost model's off-switch)            >= 0.97x
  chat-c64  chat questions, 64 at once                                          >= 0.97x
A pass runs a workload on both engines, alternating which goes first between passes (so a drifting machine
favours neither): c1 sends each request after the previous finished, to one engine then the other request by
request (a noisy neighbour hits both alike); c64 sends all at once, to one engine then the other. The
speculative engine keeps what it learns (acceptance, step times) across passes, as a server would.
With --draft-layers N the drafts come from a draft model instead of n-grams: a copy of the embedded model's
first N layers (truncated_gguf.py; its own KV cache and runner), the goals the same.
Record results in docs/benchmark-log.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from spec_passages import chat_messages, copy_messages  # a sibling, by bare name (run as benchmarks/x.py)
from truncated_gguf import truncated_copy

from kvpilot import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
GOALS = {"copy-c1": 1.8, "chat-c1": 0.97, "copy-c64": 0.97, "chat-c64": 0.97}


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids), one output cap, and how many requests run at once (1: one after another)."""

    name: str
    prompts: list[list[int]]
    max_tokens: int
    concurrency: int


@dataclass(frozen=True)
class PassResult:
    """One engine's run of a workload: output tokens, seconds, and each request's tokens and acceptance."""

    num_tokens: int
    seconds: float
    outputs: list[list[int]]
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


def make_workloads(llm: LLM, names: list[str], smoke: bool) -> list[Workload]:
    tokenizer = llm.tokenizer
    copy = [tokenizer.encode_chat(m) for m in copy_messages()]
    chat = [tokenizer.encode_chat(m) for m in chat_messages()]
    wide = 8 if smoke else 64
    table = {
        "copy-c1": Workload("copy-c1", copy[:2] if smoke else copy, 24 if smoke else 256, 1),
        "chat-c1": Workload("chat-c1", chat[:2] if smoke else chat, 16 if smoke else 128, 1),
        "copy-c64": Workload("copy-c64", [copy[i % len(copy)] for i in range(wide)], 16 if smoke else 128, wide),
        "chat-c64": Workload("chat-c64", [chat[i % len(chat)] for i in range(wide)], 16 if smoke else 128, wide),
    }
    return [table[name] for name in names]


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float]:
    start = time.perf_counter()
    finals = llm.generate(prompts, params)
    return finals, time.perf_counter() - start


def _result(finals: list, seconds: float) -> PassResult:
    outputs = [o.outputs[0].token_ids for o in finals]
    return PassResult(sum(map(len, outputs)), seconds, outputs,
                      sum(o.metrics.num_draft_tokens for o in finals),
                      sum(o.metrics.num_accepted_tokens for o in finals))


def run_pass(engines: dict[str, LLM], work: Workload, first: str) -> dict[str, PassResult]:
    """Both engines' run of the workload, `first` going first (request by request at concurrency 1)."""
    params = SamplingParams(temperature=0, max_tokens=work.max_tokens)
    order = [first, *(name for name in engines if name != first)]
    finals: dict[str, list] = {name: [] for name in order}
    seconds = dict.fromkeys(order, 0.0)
    batches = [[p] for p in work.prompts] if work.concurrency == 1 else [work.prompts]
    for batch in batches:
        for name in order:
            outputs, elapsed = _timed(engines[name], batch, params)
            finals[name] += outputs
            seconds[name] += elapsed
    return {name: _result(finals[name], seconds[name]) for name in order}


def compare(plain: LLM, spec: LLM, work: Workload, passes: int) -> None:
    ratios, plain_rates, spec_rates = [], [], []
    drafted = accepted = mismatches = 0
    for i in range(passes):
        results = run_pass({"plain": plain, "spec": spec}, work, "plain" if i % 2 == 0 else "spec")
        base, fast = results["plain"], results["spec"]
        ratios.append(fast.tokens_per_s / base.tokens_per_s)
        plain_rates.append(base.tokens_per_s)
        spec_rates.append(fast.tokens_per_s)
        drafted, accepted = drafted + fast.num_draft_tokens, accepted + fast.num_accepted_tokens
        mismatches += sum(a != b for a, b in zip(base.outputs, fast.outputs))
    goal = GOALS[work.name]
    median = statistics.median(ratios)
    verdict = "meets" if median >= goal else "MISSES"
    acceptance = f"{accepted}/{drafted} drafts accepted" if drafted else "no drafts"
    print(f"{work.name:9s} plain {statistics.median(plain_rates):7.1f} tok/s  spec {statistics.median(spec_rates):7.1f}"
          f" tok/s  ratio {median:.3f}x (passes {min(ratios):.3f}..{max(ratios):.3f}; goal >= {goal}x: {verdict})  "
          f"{acceptance}; {mismatches} outputs differ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(GOALS), choices=list(GOALS))
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--dtype", default="auto", help="auto: what kvpilot picks on this machine")
    parser.add_argument("--smoke", action="store_true", help="one short pass of small workloads")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="speculate with a draft model: the embedded model's first N layers (default: n-gram)")
    args = parser.parse_args()
    plain = LLM(dtype=args.dtype, max_num_seqs=64, max_model_len=2048)
    config = NGRAM
    if args.draft_layers is not None:
        draft = truncated_copy(Path(plain.loaded.source), Path(tempfile.mkdtemp()) / "draft.gguf",
                               args.draft_layers)
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    spec = LLM(loaded=plain.loaded, max_num_seqs=64, max_model_len=2048, speculative_config=config)
    passes = 1 if args.smoke else args.passes
    workloads = make_workloads(plain, args.workloads, args.smoke)
    for llm in (plain, spec):  # warm-up: kernels built, caches touched
        llm.generate([workloads[0].prompts[0]], SamplingParams(temperature=0, max_tokens=8))
    print(f"{passes} pass(es) a workload, dtype {plain.loaded.dtype}, speculative_config {config}")
    for work in workloads:
        compare(plain, spec, work, passes)


if __name__ == "__main__":
    main()
