"""The KV budget's measurements: one forward of a whole token budget through a throwaway runner (so the
device's peak memory shows the largest step's activations), and CUDA's vLLM-style budget from it. With
tensor parallelism every rank runs them at once (the layers' all-reduces pair the ranks' forwards up)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpilot.engine.config import cdiv
from kvpilot.engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.model.loader import LoadedModel
from kvpilot.model.runner import ModelRunner, RunnerLimits
from kvpilot.sampling_params import SamplingParams


def profile_forward(loaded: LoadedModel, num_tokens: int, block_size: int, kv_dtype: torch.dtype,
                    measure_cache: Callable[[], int] = lambda: 0) -> int:
    """Runs one step of `num_tokens` prompt tokens (a full token budget) through a throwaway runner with a cache
    just big enough, so the device's peak memory shows the activations of the largest step; returns what
    `measure_cache` says once the runner (and its cache) exist. The budget is split into prompts no longer
    than the model's position table (a budget may exceed max_model_len; a step never holds a longer prompt)."""
    max_len = loaded.model.rotary.max_positions
    lengths = [min(max_len, num_tokens - start) for start in range(0, num_tokens, max_len)]
    blocks_per_seq = cdiv(max(lengths), block_size)
    runner = ModelRunner(loaded, blocks_per_seq * len(lengths), block_size, kv_dtype,
                         limits=RunnerLimits(max_num_seqs=len(lengths), max_model_len=blocks_per_seq * block_size))
    cache_bytes = measure_cache()
    news = [NewRequestData(f"profile-{i}", [0] * n, [], SamplingParams(),
                           list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), 0)
            for i, n in enumerate(lengths)]
    chunks = [ScheduledChunk(new.request_id, 0, n, True) for new, n in zip(news, lengths)]
    runner.forward_logits(SchedulerOutput(chunks, new_requests=news))
    return cache_bytes


def cuda_kv_budget(loaded: LoadedModel, utilization: float, num_tokens: int, block_size: int,
                   kv_dtype: torch.dtype) -> int:
    """vLLM-style: GPU memory * utilization, minus what is in use, minus a full-budget forward's activations."""
    device = loaded.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    cache_bytes = profile_forward(loaded, num_tokens, block_size, kv_dtype,
                                  lambda: torch.cuda.memory_allocated(device) - baseline)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - baseline - cache_bytes
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(total * utilization - (total - free) - activations)
