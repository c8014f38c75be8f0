"""Decode-step profile: B requests of prompt length L decoding together on the embedded model (or --model); prints
the mean step time (ms), tokens/s, and the top operators by self CPU time (torch.profiler).

    .venv/bin/python benchmarks/decode_step.py --batch 64 --context 300 --steps 10
    .venv/bin/python benchmarks/decode_step.py --model ~/.cache/kvpilot-peers/models/SmolLM2-135M-Instruct.Q4_K_M.gguf \
        --dtype auto --batch 1 --steps 200
    .venv/bin/python benchmarks/decode_step.py --dtype auto --batch 64 --steps 80 --compare-greedy-head
    .venv/bin/python benchmarks/decode_step.py --model <a GGUF> --dtype auto --batch 1 --context 128 --steps 128 \
        --breakdown

This is the micro-benchmark behind engine speed changes: the offline throughput's decode phase is these steps.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvpilot import LLM, SamplingParams


def fill_to_decode(llm: LLM, batch: int, context: int, max_tokens: int, seed: int) -> None:
    """Adds `batch` requests and steps until every one has finished its prefill (all now decode)."""
    rng = random.Random(seed)
    vocab = llm.loaded.config.vocab_size
    for _ in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(context)]
        llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    produced: set[str] = set()
    while len(produced) < batch:
        produced.update(o.request_id for o in llm.engine.step())


def timed_steps(llm: LLM, steps: int) -> list[float]:
    """Seconds of each step (a shared VM's noise comes in bursts: the median and min are steadier than a mean)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    return times


def alternate(llm: LLM, steps: int, variants: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Median step ms of each variant (its callable switches the engine to it), alternating in rounds of steps/4
    (a shared VM's slow phases hit all alike); the first variant is switched back on at the end."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(4):
        for name, switch in variants.items():
            switch()
            times[name] += timed_steps(llm, max(1, steps // 4))
    next(iter(variants.values()))()
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def compare_fused(llm: LLM, batch: int, steps: int) -> None:
    """The fused decode kernel against the layer-by-layer forward."""
    model = llm.engine.runner.model
    fused = model.fused_decode
    if fused is None:
        raise SystemExit("the fused decode path does not apply to this model (it needs bf16 activations and "
                         "packed GGUF weights on CPU: --dtype auto or bfloat16, --quantization auto or gguf)")
    ms = alternate(llm, steps, {"fused": lambda: setattr(model, "fused_decode", fused),
                                "layer by layer": lambda: setattr(model, "fused_decode", None)})
    fused_ms, layers_ms = ms.values()
    print(f"decode step, batch {batch}: fused {fused_ms:.2f} ms, layer by layer {layers_ms:.2f} ms "
          f"({layers_ms / fused_ms:.2f}x; medians of {steps // 4 * 4} steps each, {torch.get_num_threads()} "
          f"threads)")


def breakdown(llm: LLM, steps: int) -> None:
    """Per step: the fused decode layers, the output head's greedy argmax and everything else (inputs, embedding,
    norms, scheduling, outputs), medians over the steps; each part timed around its call."""
    from kvpilot.model.fused_decode import FusedDecode
    from kvpilot.model.quant.linear import PackedLinear

    parts: dict[str, float] = {}

    def timed(cls: type, name: str, label: str) -> None:
        original = getattr(cls, name)

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a pass-through
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                parts[label] = parts.get(label, 0.0) + time.perf_counter() - start
        setattr(cls, name, call)

    timed(FusedDecode, "__call__", "layers (fused)")
    timed(PackedLinear, "greedy_ids", "output head argmax")
    rows: dict[str, list[float]] = {"step": [], "layers (fused)": [], "output head argmax": [], "the rest": []}
    for _ in range(steps):
        parts.clear()
        start = time.perf_counter()
        llm.engine.step()
        rows["step"].append(time.perf_counter() - start)
        rows["layers (fused)"].append(parts.get("layers (fused)", 0.0))
        rows["output head argmax"].append(parts.get("output head argmax", 0.0))
        rows["the rest"].append(rows["step"][-1] - sum(parts.values()))
    print(", ".join(f"{name} {statistics.median(values) * 1e3:.3f} ms" for name, values in rows.items())
          + f" (medians of {steps} steps; {torch.get_num_threads()} threads)")


def compare_greedy_head(llm: LLM, batch: int, steps: int) -> None:
    """Greedy ids folded in the output head (LlamaForCausalLM.greedy_ids) against float32 logits + argmax."""
    model = llm.engine.runner.model
    ms = alternate(llm, steps, {"argmax in the head": lambda: model.__dict__.pop("greedy_ids", None),
                                "logits + argmax": lambda: setattr(model, "greedy_ids", lambda hidden: None)})
    head_ms, logits_ms = ms.values()
    print(f"decode step, batch {batch}: argmax in the head {head_ms:.2f} ms, logits + argmax {logits_ms:.2f} ms "
          f"({logits_ms / head_ms:.3f}x; medians of {steps // 4 * 4} steps each, {torch.get_num_threads()} threads)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the embedded model)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", default="6GiB",
                        help="Enough for batch x (context + steps) tokens, or preemptions distort the steps.")
    parser.add_argument("--quantization", default="auto", help="auto | gguf (packed) | none (dense)")
    parser.add_argument("--profile", action="store_true", help="Also print the top operators.")
    parser.add_argument("--breakdown", action="store_true",
                        help="Time each step's fused decode layers, the packed output head's argmax and the rest.")
    parser.add_argument("--compare-fused", action="store_true",
                        help="packed models (bf16 or float32) and dense bf16 ones: alternate the fused decode kernel "
                             "(kvpilot.model.fused_decode) and the layer-by-layer forward on the same requests; print both and the ratio.")
    parser.add_argument("--compare-greedy-head", action="store_true",
                        help="Alternate greedy ids taken in the packed output head (no logits written) and float32 "
                             "logits + argmax on the same requests; print both and the ratio.")
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.context + 4 * args.steps + 16, max_num_seqs=args.batch,
              kv_cache_memory=args.kv_cache_memory, quantization=args.quantization)
    fill_to_decode(llm, args.batch, args.context, max_tokens=4 * args.steps + 16, seed=0)
    gc.collect()
    gc.freeze()  # as the server does after start-up: steps then time without collecting the model's objects
    timed_steps(llm, 2)  # warm-up
    if args.breakdown:
        breakdown(llm, args.steps)
        return
    if args.compare_fused or args.compare_greedy_head:
        (compare_fused if args.compare_fused else compare_greedy_head)(llm, args.batch, args.steps)
        return
    times = timed_steps(llm, args.steps)
    step_s = statistics.median(times)
    print(f"decode step: batch {args.batch}, context ~{args.context}: {step_s * 1e3:.1f} ms "
          f"= {args.batch / step_s:.1f} tok/s (median of {args.steps}; min {min(times) * 1e3:.1f} ms; "
          f"{torch.get_num_threads()} threads, {args.dtype}, quantization {args.quantization})")
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            timed_steps(llm, args.steps)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
