"""Offline throughput: kvpilot (continuous batching, paged KV) vs HF transformers `generate` (static batches),
same model, weights, dtype and workload, one after the other in one run. Prints both and the ratio.

    .venv/bin/python benchmarks/offline_throughput.py                 # 128 requests, prompts 32-512, outputs 32-256
    .venv/bin/python benchmarks/offline_throughput.py --num-requests 32 --hf-batch-size 16

Only useful tokens count: a static batch runs until its longest output, but each request is credited with its
own output length (the padding and the wasted steps are exactly what static batching costs).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from kvpilot import LLM, SamplingParams
from kvpilot.model.dtypes import resolve_dtype
from kvpilot.model.default_model import default_model_path


def make_workload(tokenizer, num_requests: int, seed: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int]) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    text = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog while engineers measure "
                    f"latency, throughput and memory of language models." for i in range(400))
    corpus = tokenizer.encode(text)
    work = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_range)
        start = rng.randint(0, len(corpus) - n - 1)
        work.append((corpus[start:start + n], rng.randint(*output_range)))
    return work


def run_kvpilot(llm: LLM, work) -> tuple[int, float]:
    prompts = [p for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs), elapsed


def load_hf(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()


@torch.inference_mode()
def run_hf(model, work, batch_size: int, pad_id: int) -> tuple[int, float]:
    useful, start = 0, time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):  # left padding, as HF wants for batched generation
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        longest = max(n for _, n in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=pad_id)
        useful += sum(n for _, n in batch)
    return useful, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: what kvpilot picks on this CPU (float32 without native bf16), used for both.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="kvpilot's KV storage (auto = the model dtype; float16/bfloat16 halve attention reads).")
    parser.add_argument("--skip-hf", action="store_true", help="Only measure kvpilot.")
    args = parser.parse_args()
    args.dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")

    llm = LLM(dtype=args.dtype, max_model_len=1024, kv_cache_dtype=args.kv_cache_dtype)
    work = make_workload(llm.tokenizer, args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len))
    llm.generate([work[0][0]], SamplingParams(max_tokens=4))  # warm-up
    kv_tokens, kv_time = run_kvpilot(llm, work)
    print(f"kvpilot      : {kv_tokens} output tokens in {kv_time:7.1f} s = {kv_tokens / kv_time:7.1f} tok/s")
    if args.skip_hf:
        return
    del llm
    hf = load_hf(getattr(torch, args.dtype))
    hf_tokens, hf_time = run_hf(hf, work, args.hf_batch_size, pad_id=2)
    print(f"transformers : {hf_tokens} output tokens in {hf_time:7.1f} s = {hf_tokens / hf_time:7.1f} tok/s "
          f"(static batches of {args.hf_batch_size})")
    print(f"ratio        : kvpilot / transformers = {(kv_tokens / kv_time) / (hf_tokens / hf_time):.2f}x "
          f"({args.num_requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, outputs "
          f"{args.output_len[0]}-{args.output_len[1]}, {args.dtype}, KV {args.kv_cache_dtype}, "
          f"{torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
