"""Host overhead of one engine step: a 1-layer, 64-wide dummy model (so model compute is negligible) decoding
B requests at context ~C; prints the step time, the time spent inside the model's forward, and the rest
(scheduling, input building, sampling, outputs) per running request: the median over steps of each step's
time outside the forward.

    .venv/bin/python benchmarks/host_overhead.py                      # batch 16 and 256, context 200 and 1800
    .venv/bin/python benchmarks/host_overhead.py --batch 256 --context 1800 --steps 30
    .venv/bin/python benchmarks/host_overhead.py --context 200 --evict-mib 64   # caches as cold as at 1800
    .venv/bin/python benchmarks/host_overhead.py --skip-forward      # the host work alone, no layers run

Host time per request rises with context on a CPU although no host work grows with it: a long-context forward
streams the KV cache through the CPU caches and evicts the interpreter's objects, so the host code after it
runs cold. --evict-mib N makes every forward also touch N MiB (counted as forward time): at a short context it
shows how much of the long-context figure is that eviction alone. --skip-forward does the opposite: the
model's layers do not run at all (the forward returns a zero hidden state; the logits head still runs), so
nothing evicts the host's data between steps and what is left is the host work alone, at any context.

The engine issue's target: host cost per running request per step <= 10 us on a 2-core CPU, flat in context.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvpilot import LLM, SamplingParams

# 64 wide, one layer, a small vocabulary: the forward is a few tiny GEMMs, so what is left is host work
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
    "vocab_size": 2048, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


class ForwardTimer:
    """Wraps the model's forward and the logits head to add up the seconds spent inside them. skip_forward:
    the forward returns zeros of its output's shape instead of running the layers (no KV read or written)."""

    def __init__(self, model: torch.nn.Module, evict_mib: int = 0, skip_forward: bool = False) -> None:
        self.seconds = 0.0
        self._evict = torch.zeros(evict_mib * 2**20 // 4) if evict_mib else None
        hidden_size = model.embed_tokens.weight.shape[1]
        self._zeros = torch.zeros(8192, hidden_size) if skip_forward else None
        for name in ("forward", "logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn):  # noqa: ANN001, ANN202 - a plain wrapper
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            if self._evict is not None and fn.__name__ == "forward":
                self._evict.add_(1.0)  # what a long context's KV reads do to the caches, and nothing else
            if self._zeros is not None and fn.__name__ == "forward":
                self.seconds += time.perf_counter() - start
                return self._zeros[:len(args[0])]  # args[0]: the step's token ids
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return run


def measure(config_path: Path, batch: int, context: int, steps: int, extra: dict, evict_mib: int = 0,
            skip_forward: bool = False) -> dict:
    budget = max(2048, batch)
    # requests prefilled early decode while the rest prefill: none may finish before the timed steps end
    max_tokens = batch * context // budget + steps + 64
    llm = LLM(str(config_path), load_format="dummy", dtype="float32", max_model_len=context + max_tokens + 8,
              max_num_seqs=batch, max_num_batched_tokens=budget, kv_cache_memory="1GiB", **extra)
    rng = random.Random(0)
    for _ in range(batch):
        prompt = [rng.randrange(3, TINY_CONFIG["vocab_size"]) for _ in range(context)]
        llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:  # prefill everything first: the timed steps are pure decodes
        started.update(o.request_id for o in llm.engine.step())
    for _ in range(3):
        llm.engine.step()
    timer = ForwardTimer(llm.engine.runner.model, evict_mib, skip_forward)
    times, hosts = [], []
    for _ in range(steps):
        in_forward = timer.seconds
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
        hosts.append(times[-1] - (timer.seconds - in_forward))
    step_s = statistics.median(times)
    forward_s = timer.seconds / steps
    # The median of each step's own host time: a step slowed by the shared box (in or out of the forward)
    # moves neither it nor the step median much, where median step minus mean forward mixed the two.
    host_s = statistics.median(hosts)
    return {"batch": batch, "context": context, "step_ms": step_s * 1e3, "min_step_ms": min(times) * 1e3,
            "forward_ms": forward_s * 1e3, "host_us_per_request": host_s / batch * 1e6,
            "min_host_us_per_request": min(hosts) / batch * 1e6, "step_us_per_request": step_s / batch * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[200, 1800])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                        help="Extra LLM() setting, e.g. async_scheduling=false (repeatable).")
    parser.add_argument("--evict-mib", type=int, default=0,
                        help="Also touch this many MiB in every forward, evicting the CPU caches (see above).")
    parser.add_argument("--skip-forward", action="store_true",
                        help="Run no layers in the timed steps: the host work alone, caches warm (see above).")
    parser.add_argument("--json", action="store_true", help="One JSON line per measurement.")
    args = parser.parse_args()
    extra = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.engine_arg)}
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps(TINY_CONFIG))
        evicting = f"; every forward touches {args.evict_mib} MiB" if args.evict_mib else ""
        evicting += "; layers skipped" if args.skip_forward else ""
        print(f"# {torch.get_num_threads()} threads; 1-layer 64-wide dummy model; {args.steps} decode steps each"
              f"{evicting}")
        for context in args.context:
            for batch in args.batch:
                row = measure(config_path, batch, context, args.steps, extra, args.evict_mib, args.skip_forward)
                if args.json:
                    print(json.dumps(row))
                    continue
                print(f"batch {batch:4d} context {context:5d}: step {row['step_ms']:7.2f} ms (min "
                      f"{row['min_step_ms']:.2f}), in forward {row['forward_ms']:6.2f} ms, host "
                      f"{row['host_us_per_request']:6.1f} us/request (min {row['min_host_us_per_request']:.1f}; "
                      f"step {row['step_us_per_request']:.1f})")


if __name__ == "__main__":
    main()
