"""GPU throughput and latency, every figure of the GPU issue's table in one run (dummy weights, no files):
kvpilot next to HF transformers on the same weights where the table has a transformers column, each
against the issue's target. About 5-8 minutes on one H100; --smoke runs tiny shapes on any device.

    python benchmarks/gpu_throughput.py                       # all rows (CUDA), --output result.json
    python benchmarks/gpu_throughput.py --rows qwen3-b1 llama-b1 --attention-backend torch
    python benchmarks/gpu_throughput.py --smoke               # tiny models and workloads: checks it runs

Rows: the nano-vllm bench shape (Qwen3-0.6B, 256 requests, input and output lengths uniform in 100-1024,
ignore_eos, random token ids); Qwen3-0.6B batch-1 decode (512 in / 256 out); Llama-3.1-8B 64 x 512/256 and
batch 1; Llama-3.1-8B time to first token of one 32k-token prompt (default token budget and 16k). Output
tok/s counts only requested tokens (a static HF batch is credited each request's own length).
"""

from __future__ import annotations

import argparse
import gc
import logging
import json
import random
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hf_mirror import hf_mirror
from step_breakdown import StepBreakdown
from kvpilot import LLM, SamplingParams
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.model.loader import LoadedModel, load_model


@dataclass(frozen=True)
class Row:
    key: str
    title: str
    model: str  # catalog name
    num_requests: int
    input_range: tuple[int, int]
    output_range: tuple[int, int]
    target: float | None  # the issue's target: output tok/s, or seconds for a TTFT row
    ttft: bool = False  # time to first token of the first request (output_range is (1, 1))
    max_num_batched_tokens: int | None = None
    hf_requests: int = 0  # run this many of the requests in HF transformers too (0: not at all)
    hf_batch_size: int = 1


FULL_ROWS = [
    Row("nano-vllm", "Qwen3-0.6B, 256 req, in/out 100-1024", "qwen3-0.6b", 256, (100, 1024), (100, 1024),
        15_000, hf_requests=64, hf_batch_size=64),
    Row("qwen3-b1", "Qwen3-0.6B batch 1, 512 in / 256 out", "qwen3-0.6b", 1, (512, 512), (256, 256), 500,
        hf_requests=1),
    Row("llama-64", "Llama-3.1-8B, 64 req x 512 in / 256 out", "llama-3.1-8b", 64, (512, 512), (256, 256), 5_000),
    Row("llama-b1", "Llama-3.1-8B batch 1, 512 in / 256 out", "llama-3.1-8b", 1, (512, 512), (256, 256), 150),
    Row("llama-ttft", "Llama-3.1-8B TTFT, 32k prompt (default budget)", "llama-3.1-8b", 1, (32768, 32768), (1, 1),
        1.5, ttft=True),
    Row("llama-ttft-16k", "Llama-3.1-8B TTFT, 32k prompt (16k budget)", "llama-3.1-8b", 1, (32768, 32768), (1, 1),
        1.5, ttft=True, max_num_batched_tokens=16384),
]
SMOKE_SHAPE = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}
CHECK_TOKENS = 8  # greedy tokens compared between kvpilot and the HF mirror (same weights, same prompt)
SMOKE_ROWS = [
    Row("nano-vllm", "tiny Qwen3, 8 req, in/out 8-32", "qwen3-0.6b", 8, (8, 32), (8, 32), None, hf_requests=4,
        hf_batch_size=4),
    Row("qwen3-b1", "tiny Qwen3 batch 1, 16 in / 8 out", "qwen3-0.6b", 1, (16, 16), (8, 8), None, hf_requests=1),
    Row("llama-64", "tiny Llama, 4 req x 16 in / 8 out", "llama-3.1-8b", 4, (16, 16), (8, 8), None),
    Row("llama-ttft", "tiny Llama TTFT, 300-token prompt", "llama-3.1-8b", 1, (300, 300), (1, 1), None, ttft=True,
        max_num_batched_tokens=128),
]


@dataclass
class Result:
    key: str
    title: str
    kvpilot: float  # output tok/s, or TTFT seconds
    hf: float | None
    target: float | None
    ttft: bool
    seconds: float  # wall time of the row, setup included
    hf_agree: int | None = None  # leading greedy tokens of request 0 where HF and kvpilot agree (of CHECK_TOKENS)


def make_requests(row: Row, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    high = min(vocab_size, 10_000) - 1  # as nano-vllm's bench draws its ids
    return [([rng.randint(0, high) for _ in range(rng.randint(*row.input_range))], rng.randint(*row.output_range))
            for _ in range(row.num_requests)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_kvpilot(llm: LLM, requests: list[tuple[list[int], int]]) -> tuple[int, float]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    _sync()
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params)
    _sync()
    return sum(len(o.outputs[0].token_ids) for o in outputs), time.perf_counter() - start


def warm_up(llm: LLM, requests: list[tuple[list[int], int]], ttft: bool) -> None:
    """Compiles every kernel variant the row will use: a long prompt, and decodes split and unsplit. The
    prompt is reversed: the measured run must not find its first blocks in the prefix cache (a TTFT row
    measured 28,672 of its 32,768 tokens that way until 2026-11-27)."""
    prompt = list(reversed(requests[0][0]))[:4096 if ttft else None]
    short = [([1 + i % 7] * 24, 4) for i in range(32)] if len(requests) > 1 else []  # a batch: unsplit decodes
    run_kvpilot(llm, [(prompt, 1 if ttft else 8)] + short)


@torch.inference_mode()
def run_hf(model, requests: list[tuple[list[int], int]], batch_size: int) -> tuple[int, float]:
    device = next(model.parameters()).device
    useful = 0
    _sync()
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):  # left padding, as HF wants for batched generation
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        longest = max(n for _, n in batch)
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                       min_new_tokens=longest, do_sample=False, pad_token_id=0)
        useful += sum(n for _, n in batch)
    _sync()
    return useful, time.perf_counter() - start


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_row(loaded: LoadedModel, hf_config: dict, row: Row, args: argparse.Namespace) -> Result:
    began = time.perf_counter()
    requests = make_requests(row, loaded.config.vocab_size, args.seed)
    max_len = max(len(p) + n for p, n in requests) + 16
    llm = LLM(loaded=loaded, max_model_len=max_len, max_num_seqs=max(row.num_requests, 1),
              max_num_batched_tokens=row.max_num_batched_tokens or args.max_num_batched_tokens,
              attention_backend=args.attention_backend,
              kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
              async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])
    warm_up(llm, requests, row.ttft)
    breakdown = StepBreakdown() if args.step_breakdown else None
    if breakdown is not None:
        breakdown.watch(llm.engine)
    tokens, seconds = run_kvpilot(llm, requests)
    if breakdown is not None:
        print(breakdown.report(), flush=True)
    kvpilot = seconds if row.ttft else tokens / seconds
    check = llm.generate([requests[0][0]], SamplingParams(temperature=0, max_tokens=CHECK_TOKENS, ignore_eos=True))
    del llm
    _free()
    print(f"{row.title}: kvpilot {kvpilot:.3f} ({tokens} tokens in {seconds:.2f} s)", flush=True)
    hf = agree = None
    if row.hf_requests and not args.skip_hf and (args.hf_rows is None or row.key in args.hf_rows):
        try:
            hf, agree = _run_hf_side(loaded, hf_config, row, requests, list(check[0].outputs[0].token_ids))
        except Exception:  # noqa: BLE001  (keep kvpilot's figure when the reference side breaks)
            traceback.print_exc()
        _free()
    return Result(row.key, row.title, kvpilot, hf, row.target, row.ttft, time.perf_counter() - began, agree)


def _run_hf_side(loaded: LoadedModel, hf_config: dict, row: Row, requests: list[tuple[list[int], int]],
                 check_ids: list[int]) -> tuple[float, int]:
    """(HF output tok/s on the row's first hf_requests, leading greedy tokens where HF agrees with kvpilot)."""
    model = hf_mirror(loaded, hf_config)
    agree = _leading_agreement(model, requests[0][0], check_ids)
    subset = requests[:row.hf_requests]
    run_hf(model, [(subset[0][0], 2)], 1)  # warm-up
    hf_tokens, hf_seconds = run_hf(model, subset, row.hf_batch_size)
    del model
    return hf_tokens / hf_seconds, agree


@torch.inference_mode()
def _leading_agreement(model, prompt: list[int], kvpilot_ids: list[int]) -> int:
    """How many leading greedy tokens HF produces identically (shows the mirror holds the same weights;
    bf16 may part after a few tokens, float32 should not)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(kvpilot_ids),
                         min_new_tokens=len(kvpilot_ids), do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    return next((i for i, (a, b) in enumerate(zip(out, kvpilot_ids)) if a != b), min(len(out), len(kvpilot_ids)))


def model_source(name: str, smoke: bool, workdir: Path) -> tuple[str, dict]:
    """(what load_model takes, the HF config dict): the catalog name, or a tiny config.json for --smoke."""
    config = get_hf_config(name)
    if not smoke:
        return name, config
    config = {**config, **SMOKE_SHAPE}
    config.pop("rope_scaling", None)
    path = workdir / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return str(path), config


def format_table(results: list[Result]) -> str:
    lines = [f"{'row':<48} {'kvpilot':>10} {'HF':>9} {'x HF':>6} {'target':>8} {'of target':>9} {'row s':>6} "
             f"{'HF agrees':>9}"]
    for r in results:
        unit = "s" if r.ttft else ""
        ratio = f"{r.kvpilot / r.hf:.2f}" if r.hf else "-"
        reached = (r.target / r.kvpilot if r.ttft else r.kvpilot / r.target) if r.target else None
        lines.append(f"{r.title:<48} {r.kvpilot:>9.{3 if r.ttft else 0}f}{unit} "
                     f"{(f'{r.hf:.0f}' if r.hf else '-'):>9} {ratio:>6} "
                     f"{(f'{r.target:g}{unit}' if r.target else '-'):>8} "
                     f"{(f'{reached:.2f}x' if reached else '-'):>9} {r.seconds:>6.0f} "
                     f"{(f'{r.hf_agree}/{CHECK_TOKENS}' if r.hf_agree is not None else '-'):>9}")
    return "\n".join(lines)


def environment(args: argparse.Namespace) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu, "torch": torch.__version__,
            "triton": triton_version, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
            "attention_backend": args.attention_backend, "enforce_eager": args.enforce_eager,
            "quantization": args.quantization, "async_scheduling": args.async_scheduling, "smoke": args.smoke}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="Tiny models and workloads (CPU is fine).")
    parser.add_argument("--rows", nargs="*", help=f"Only these rows: {' '.join(r.key for r in FULL_ROWS)}")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--dtype", default=None, help="Default: bfloat16 on CUDA, float32 otherwise.")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="No CUDA graphs (decode steps run eagerly).")
    parser.add_argument("--quantization", default="none", help="none, or fp8 (weights e4m3 per channel).")
    parser.add_argument("--hf-rows", nargs="*", help="Run HF transformers only on these rows (default: all that have it).")
    parser.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--step-breakdown", action="store_true",
                        help="Print each row's wall time split into steps with prompt tokens and decode-only steps.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="The token budget of rows that do not set their own (default: the engine's).")
    parser.add_argument("--output", type=Path, help="Also write the results and environment as JSON.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("kvpilot.model.cuda_graphs").setLevel(logging.INFO)  # capture time and memory
    args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    rows = [r for r in (SMOKE_ROWS if args.smoke else FULL_ROWS) if not args.rows or r.key in args.rows]
    print(json.dumps(environment(args)), flush=True)
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in dict.fromkeys(r.model for r in rows):
            source, hf_config = model_source(name, args.smoke, Path(workdir))
            began = time.perf_counter()
            longest = max(r.input_range[1] + r.output_range[1] for r in rows if r.model == name) + 16
            loaded = load_model(source, load_format="dummy", dtype=args.dtype, max_model_len=longest, seed=args.seed,
                                quantization=args.quantization)
            print(f"{name}: dummy weights in {time.perf_counter() - began:.1f} s", flush=True)
            for row in (r for r in rows if r.model == name):
                try:
                    results.append(run_row(loaded, hf_config, row, args))
                except Exception:  # noqa: BLE001  (one failing row must not cost the others' figures)
                    traceback.print_exc()
                    print(f"{row.title}: FAILED (traceback above)", flush=True)
                    _free()
                    continue
                print(format_table(results[-1:]).splitlines()[1], flush=True)
            del loaded
            _free()
    print(format_table(results))
    if args.output:
        args.output.write_text(json.dumps({"environment": environment(args),
                                           "results": [asdict(r) for r in results]}, indent=1))


if __name__ == "__main__":
    main()
