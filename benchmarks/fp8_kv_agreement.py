"""How far fp8 KV cache output stays with the model dtype's: greedy, N tokens (256 by default, ignore_eos), the
same prompts with KV stored in the model dtype (the reference), in fp8 with calibrated scales (the default,
model/kv_scales.py) and in fp8 with scales of 1 (`calculate_kv_scales=False`, vLLM's default). For each fp8
run: prompts whose output is identical, and where the first token differs (median and min over prompts). Free
greedy decoding diverges for good at its first different token, so each run is also teacher-forced: at every
`--stride`-th position of the reference's output, the run's next token after the reference's prefix (one
1-token request each; prefix caching reuses the run's own cache), and the share equal to the reference's.

    .venv/bin/python benchmarks/fp8_kv_agreement.py                                  # embedded model, CPU
    .venv/bin/python benchmarks/fp8_kv_agreement.py --model Qwen/Qwen3-0.6B --device cuda --tokens 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_passages import CHAT_QUESTIONS, PASSAGES  # noqa: E402

from kvpilot import LLM, SamplingParams  # noqa: E402

RUNS = (("reference", {}), ("fp8, calibrated", {"kv_cache_dtype": "fp8"}),
        ("fp8, scale 1", {"kv_cache_dtype": "fp8", "calculate_kv_scales": False}))


def prompts(num: int) -> list[str]:
    """Chat questions, then passages to continue, cycled to `num`."""
    pool = [*CHAT_QUESTIONS, *(f"Continue this text:\n\n{p[:600]}" for p in PASSAGES)]
    return [pool[i % len(pool)] for i in range(num)]


def first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first differing token (the common length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def forced_agreement(llm: LLM, prompt_ids: list[list[int]], reference: list[list[int]], stride: int) -> float:
    """The share of positions i (every `stride`-th) where the run's greedy token after prompt + reference[:i]
    is reference[i]."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    cases = [(ids + ref[:i], ref[i]) for ids, ref in zip(prompt_ids, reference) for i in range(0, len(ref), stride)]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _ in cases], params)
    return sum(o.outputs[0].token_ids[0] == want for o, (_, want) in zip(outputs, cases)) / len(cases)


def scales_line(llm: LLM) -> str:
    """The range of the run's fp8 KV scales over layers and heads (in-process runners only)."""
    scales = getattr(llm.engine.runner, "kv_scales", None)
    if not scales:
        return ""
    k = [x for s in scales for x in s.k_scale.tolist()]
    v = [x for s in scales for x in s.v_scale.tolist()]
    return f"; K scales {min(k):g}..{max(k):g}, V scales {min(v):g}..{max(v):g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--stride", type=int, default=8, help="teacher-forced positions: every N-th")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    texts = prompts(args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    forced: dict[str, float] = {}
    loaded, prompt_ids = None, []
    for name, settings in RUNS:
        llm = LLM(args.model, loaded=loaded, device=args.device, dtype=args.dtype, **settings)
        loaded = llm.loaded
        start = time.perf_counter()
        results = llm.generate(texts, params)
        outputs[name] = [list(o.outputs[0].token_ids) for o in results]
        prompt_ids = prompt_ids or [list(o.prompt_token_ids) for o in results]
        forced[name] = forced_agreement(llm, prompt_ids, outputs["reference"], args.stride)
        print(f"# {name}: {time.perf_counter() - start:.1f} s{scales_line(llm)}", flush=True)
        del llm
    reference = outputs["reference"]
    report = {"model": args.model or "embedded", "prompts": len(texts), "tokens": args.tokens, "stride": args.stride,
              "reference_forced": forced["reference"], "runs": {}}
    print(f"reference        teacher-forced agreement with itself {forced['reference']:.1%} (the check's floor)")
    for name, _ in RUNS[1:]:
        firsts = [first_difference(a, b) for a, b in zip(reference, outputs[name])]
        same = sum(f == args.tokens for f in firsts)
        report["runs"][name] = {"identical": same, "first_difference": firsts, "forced_agreement": forced[name]}
        print(f"{name:<16} identical {same}/{len(texts)}; first differing token: median "
              f"{statistics.median(firsts):.0f}, min {min(firsts)} (of {args.tokens}); teacher-forced agreement "
              f"{forced[name]:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
