"""How far bf16 and fp8 logits are from float32 ones on the same weights (dummy, one seed): relative error
of the logits of every prompt position, and how often their argmax agrees, through the model runner and the
default attention backend (Triton on CUDA). The issue's "documented error bounds" come from this.

    python benchmarks/gpu_numerics.py                                # Qwen3-0.6B on the GPU
    python benchmarks/gpu_numerics.py --model smollm2-135m --prompt-len 64 --device cpu   # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import random

import torch

from kvpilot.engine.scheduler_output import NewRequestData, RunningRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.model.loader import load_model
from kvpilot.model.quant.fp8 import quantize_fp8_layers
from kvpilot.model.runner import ModelRunner
from kvpilot.sampling_params import SamplingParams

BLOCK_SIZE = 16


def all_logits(loaded, prompt: list[int]) -> torch.Tensor:
    """float32 logits [len(prompt), vocab]: one sampled chunk per prefix length would cost a forward each, so
    the prompt is split into single-token steps after a one-token prefill (every position is a sampled row)."""
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    runner = ModelRunner(loaded, num_blocks, BLOCK_SIZE)
    new = NewRequestData("r", prompt, [], SamplingParams(), list(range(num_blocks)), 0)
    rows = [runner.forward_logits(SchedulerOutput([ScheduledChunk("r", 0, 1, True)], new_requests=[new]))[1]]
    for position in range(1, len(prompt)):
        chunk = ScheduledChunk("r", position, 1, True)
        step = SchedulerOutput([chunk], running_requests=[RunningRequestData("r", [], position)])
        rows.append(runner.forward_logits(step)[1])
    return torch.cat(rows).float().cpu()


def compare(name: str, logits: torch.Tensor, reference: torch.Tensor) -> None:
    error = ((logits - reference).norm() / reference.norm()).item()
    worst = ((logits - reference).norm(dim=-1) / reference.norm(dim=-1)).max().item()
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"{name:<24} logits rel. error {error:.4f} (worst position {worst:.4f}), argmax agrees {agree:.1%}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="catalog name (dummy weights)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    reference_model = load_model(args.model, load_format="dummy", dtype="float32", device=args.device,
                                 max_model_len=args.prompt_len + BLOCK_SIZE, seed=args.seed)
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1, min(reference_model.config.vocab_size, 10_000)) for _ in range(args.prompt_len)]
    print(f"{args.model}, {args.prompt_len} positions, device {reference_model.device}, torch {torch.__version__}")
    reference = all_logits(reference_model, prompt)
    bf16 = copy.copy(reference_model)
    bf16.model, bf16.dtype = copy.deepcopy(reference_model.model).to(torch.bfloat16), torch.bfloat16
    bf16.model.rotary.reset_tables(bf16.device)  # .to() rounded the float32 cos/sin tables: rebuild them
    compare("bfloat16", all_logits(bf16, prompt), reference)
    fp8 = copy.copy(bf16)
    fp8.model = copy.deepcopy(bf16.model)
    quantize_fp8_layers(fp8.model)
    compare("fp8 weights + acts", all_logits(fp8, prompt), reference)


if __name__ == "__main__":
    main()
