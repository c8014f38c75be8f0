"""Where a GPU decode step's time goes: B requests of ~L context decoding together on a dummy-weight model;
wall time per step in each mode (synchronous or async scheduling, eager or CUDA graphs), then with --profile
one profiled pass of the last mode: kernel time per step, kernels per step, and the top kernels. Wall well above device time means the host
loop or launch overhead, not the GPU, sets the pace (what CUDA graphs and async scheduling are for).

    python benchmarks/gpu_step_profile.py --model qwen3-0.6b --batch 256 --context 512 --profile
    python benchmarks/gpu_step_profile.py --batch 8 --context 64 --model qwen3-0.6b   # any device
    python benchmarks/gpu_step_profile.py --batch 128 --prefill-tokens 1900 --profile   # mixed steps

--prefill-tokens N makes every timed step a mixed one, as under a steady stream of arrivals: a new N-token
prompt (max_tokens 1) is added before each step, and the step runs its prefill beside the B decodes; the
decode-only steps are then timed too, and their ratio is a stream's p99 / median gap under rare long prompts.

Each mode is timed twice: step by step with the device synchronized after each (the median: one step's own
cost, nothing overlapped across steps) and back to back with one synchronize at the end (the mean: what the
engine loop sees; async scheduling overlaps a step's host work with the previous step's kernels only here).
--sync-debug runs the last mode's back-to-back steps under torch.cuda.set_sync_debug_mode("warn") and prints
where the host waited for the device (a hidden synchronization serializes host and device).
"""

from __future__ import annotations

import argparse
import collections
import gc
import logging
import random
import statistics
import time
import traceback
import warnings

import torch

from kvpilot import LLM, SamplingParams
from kvpilot.model.loader import load_model


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fill_to_decode(llm: LLM, batch: int, context: int, max_tokens: int) -> None:
    """Adds `batch` requests and steps until all of them decode (each has produced a token)."""
    rng = random.Random(0)
    high = min(llm.loaded.config.vocab_size, 10_000) - 1
    for _ in range(batch):
        llm.engine.add_request([rng.randint(0, high) for _ in range(context)],
                               SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    produced: set[str] = set()
    while len(produced) < batch:
        produced.update(o.request_id for o in llm.engine.step())


def timed_steps(llm: LLM, steps: int, prefill_tokens: int = 0, sync_each: bool = True) -> list[float]:
    """Seconds per step: each step's own (synchronized after it), or with sync_each False one value, the
    back-to-back loop's mean."""
    _sync()
    times = []
    rng = random.Random(1)
    high = min(llm.loaded.config.vocab_size, 10_000) - 1
    prompts = [[rng.randint(0, high) for _ in range(prefill_tokens)] for _ in range(steps if prefill_tokens else 0)]
    loop_start = time.perf_counter()
    for i in range(steps):
        if prefill_tokens:  # a fresh prompt (no prefix-cache hit) to prefill beside the decodes
            llm.engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        llm.engine.step()
        if sync_each:
            _sync()
            times.append(time.perf_counter() - start)
    if not sync_each:
        _sync()
        times = [(time.perf_counter() - loop_start) / steps]
    return times


def sync_sites(llm: LLM, steps: int, prefill_tokens: int, top: int) -> None:
    """Back-to-back steps with CUDA's sync debug mode on: each place the host waited for the device, by count."""
    if not torch.cuda.is_available():
        print("sync debug: no CUDA device")
        return
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        frames = [f for f in traceback.extract_stack()[:-1] if "/kvpilot/" in f.filename]
        where = " <- ".join(f"{f.filename.rsplit('/kvpilot/', 1)[-1]}:{f.lineno}" for f in reversed(frames[-3:]))
        sites[f"{str(message)[:60]} at {where or filename + ':' + str(lineno)}"] += 1

    previous = warnings.showwarning
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        timed_steps(llm, steps, prefill_tokens, sync_each=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = previous
    print(f"sync debug: {sum(sites.values())} synchronizations in {steps} back-to-back steps")
    for site, count in sites.most_common(top):
        print(f"  {count:5d}  {site}")


def profile_steps(llm: LLM, steps: int, top: int, prefill_tokens: int) -> None:
    """Kernel time per step: the sum of device-side kernel events (not the aten ops around them)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        timed_steps(llm, steps, prefill_tokens)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(e.self_device_time_total for e in kernels) / steps
    launches = sum(e.count for e in kernels) / steps
    print(f"profiled: device time {device_us / 1e3:.2f} ms a step, ~{launches:.0f} kernels a step")
    print(events.table(sort_by="self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total",
                       row_limit=top, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="catalog name (dummy weights)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--modes", default="sync-eager,async-eager,async-graphs",
                        help="comma-separated {sync,async}-{eager,decode,graphs}: scheduling and CUDA graphs "
                        "(decode: decode-only steps' graphs alone, FULL_DECODE_ONLY; graphs: the default, "
                        "FULL_AND_PIECEWISE, steps with prompt tokens replaying piecewise graphs)")
    parser.add_argument("--profile", action="store_true", help="Profile the last mode's steps (kernels, time).")
    parser.add_argument("--sync-debug", action="store_true", help="Report where the last mode's back-to-back steps "
                        "waited for the device (torch.cuda.set_sync_debug_mode).")
    parser.add_argument("--prefill-tokens", type=int, default=0, help="Mixed steps: an N-token prompt prefilled "
                        "in each step beside the decodes (fits the token budget: N + batch <= 2,048 by default).")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    for name in ("kvpilot.model.cuda_graphs", "kvpilot.model.piecewise_graphs"):  # capture time and memory
        logging.getLogger(name).setLevel(logging.INFO)
    max_model_len = max(args.context, args.prefill_tokens) + 512
    loaded = load_model(args.model, load_format="dummy", dtype=args.dtype, max_model_len=max_model_len)
    modes = [m.strip() for m in args.modes.split(",")]
    for mode in modes:
        scheduling, graphs = mode.split("-")
        llm = LLM(loaded=loaded, max_model_len=max_model_len, max_num_seqs=args.batch + 1,
                  attention_backend=args.attention_backend, async_scheduling=scheduling == "async",
                  enforce_eager=graphs == "eager",
                  compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"} if graphs == "decode" else None,
                  kv_cache_memory=None if loaded.device.type == "cuda" else "2GiB")
        fill_to_decode(llm, args.batch, args.context, max_tokens=4 * args.steps + 64)
        timed_steps(llm, 3, args.prefill_tokens)  # warm-up
        times = timed_steps(llm, args.steps, args.prefill_tokens)
        step = statistics.median(times)
        loop = timed_steps(llm, args.steps, args.prefill_tokens, sync_each=False)[0]
        mixed = f" + a {args.prefill_tokens}-token prefill" if args.prefill_tokens else ""
        print(f"{args.model} decode, batch {args.batch}{mixed}, context ~{args.context}, {mode}: "
              f"{step * 1e3:.2f} ms a step (median of {args.steps} synchronized, min {min(times) * 1e3:.2f}); "
              f"back to back {loop * 1e3:.2f} ms = {args.batch / loop:,.0f} tok/s", flush=True)
        if args.prefill_tokens:  # a stream's gap at a step a prompt joins, against one without (#48: <= 2x)
            alone = timed_steps(llm, args.steps, sync_each=False)[0]
            print(f"  decode-only steps back to back {alone * 1e3:.2f} ms: mixed / decode-only {loop / alone:.2f}x "
                  "(ITL p99 / median where prompts join fewer than 1 step in 100)", flush=True)
        if mode == modes[-1] and args.sync_debug:
            sync_sites(llm, args.steps, args.prefill_tokens, args.top)
        if mode == modes[-1] and args.profile:
            profile_steps(llm, 5, args.top, args.prefill_tokens)
        del llm
        gc.collect()  # the engine holds reference cycles: free its KV cache before the next one is sized
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
