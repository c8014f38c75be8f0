"""How long OpenMP threads spin before they sleep, quiet and beside busy processes: decode speed of the embedded
model in one engine process per setting, side by side in one run, passes alternating the order.

    .venv/bin/python benchmarks/omp_wait.py                       # quiet: every setting, 3 passes
    .venv/bin/python benchmarks/omp_wait.py --spinners 2          # two busy processes beside it (`yes`-like)
    .venv/bin/python benchmarks/omp_wait.py --settings libgomp,3000 --passes 5

A setting is `libgomp` (libgomp's own default: GOMP_SPINCOUNT=300000 rounds, then sleep), `passive`
(OMP_WAIT_POLICY=passive: sleep at once) or a number of rounds (GOMP_SPINCOUNT; kvpilot's default is
kvpilot.omp_pool.SHORT_SPIN_COUNT). Each engine decodes `--tokens` greedy tokens for one request
(batch 1) and for `--batch` requests at once; the figure is ms a decode step (median over passes, min-max).
Why it matters: on a shared machine a thread that spins at a barrier holds a CPU that the thread it waits for
needs, so a step can take timeslices instead of microseconds. Record results in docs/benchmark-log.md with the
date and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the busy processes the doctor's tests stage
from tests.doctor.fault_staging import spinners  # noqa: E402

WORKER = r"""
import json, sys, time
from kvpilot import LLM, SamplingParams
tokens, batch = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(kv_cache_memory="512MiB", max_model_len=1024)
params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
llm.generate(["Warm up the kernels."] * 2, SamplingParams(max_tokens=4, temperature=0))
out = {}
for n in (1, batch):
    prompts = [f"Story {i}: once upon a time" for i in range(n)]
    start = time.perf_counter()
    llm.generate(prompts, params)
    out[n] = (time.perf_counter() - start) * 1000.0 / tokens
print(json.dumps(out))
"""


def setting_env(setting: str) -> dict[str, str]:
    """The environment of one setting's engine process (the user's OMP/GOMP variables removed first)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if setting == "passive":
        env["OMP_WAIT_POLICY"] = "passive"
    else:  # explicit even for libgomp's default: importing kvpilot would otherwise set its own
        env["GOMP_SPINCOUNT"] = "300000" if setting == "libgomp" else str(int(setting))
    return env


def run_setting(setting: str, tokens: int, batch: int) -> dict[int, float]:
    proc = subprocess.run([sys.executable, "-c", WORKER, str(tokens), str(batch)], env=setting_env(setting),
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{setting}: {proc.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="libgomp,3000,passive,1000,10000")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--spinners", type=int, default=0, help="busy processes beside the engine")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    settings = args.settings.split(",")
    results: dict[str, dict[int, list[float]]] = {s: {1: [], args.batch: []} for s in settings}
    with spinners(args.spinners):
        for p in range(args.passes):
            order = settings if p % 2 == 0 else settings[::-1]
            for setting in order:
                for n, ms in run_setting(setting, args.tokens, args.batch).items():
                    results[setting][n].append(ms)
                print(f"pass {p + 1} {setting}: " + json.dumps({n: v[-1] for n, v in results[setting].items()}),
                      file=sys.stderr)
    base = results[settings[0]]
    print(f"ms a decode step, median (min-max) of {args.passes} passes; {args.spinners} busy processes beside")
    print(f"{'setting':>10} {'batch 1':>22} {'batch ' + str(args.batch):>22}   vs {settings[0]} (batch 1 / batch)")
    for setting in settings:
        row = results[setting]
        ratios = [statistics.median(base[n]) / statistics.median(row[n]) for n in (1, args.batch)]
        print(f"{setting:>10} {summary(row[1]):>22} {summary(row[args.batch]):>22}   "
              f"{ratios[0]:.2f}x / {ratios[1]:.2f}x")


if __name__ == "__main__":
    main()
