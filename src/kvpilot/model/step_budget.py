"""The default token budget of one engine step (max_num_batched_tokens), by device and use, as vLLM picks it.

A bigger budget means fewer, larger steps with prompt tokens: on a GPU each such step runs eagerly (CUDA graphs
cover decode-only steps), so its host work is paid per step, and 2,048 tokens leave a large GPU mostly idle in
them (H100, Qwen3-0.6B, 256 requests of 100-1,024 tokens: 14,367 output tok/s at 2,048, 16,342 at 8,192;
Llama-3.1-8B's 32k-token TTFT 1.58 s -> 1.49 s). A smaller one bounds how long running streams wait while a
long prompt is prefilled (inter-token latency), which is why a server gets half of what an offline batch gets.

    device                                  LLM (offline)   server
    CUDA, >= 70 GiB and not an A100         16,384          8,192
    other CUDA GPUs                          8,192          2,048
    CPU                                      2,048          2,048

Never below max_num_seqs, so that a full batch of decodes fits in one step. The A100 exception is vLLM's (a
larger budget measured slower there).
"""

from __future__ import annotations

import torch

LARGE_GPU_BYTES = 70 * 2**30
_BUDGETS = {"large-gpu": {"llm": 16384, "server": 8192}, "gpu": {"llm": 8192, "server": 2048},
            "cpu": {"llm": 2048, "server": 2048}}


def device_class(device: torch.device) -> str:
    """"large-gpu", "gpu" or "cpu" (any device that is not CUDA)."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    large = props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower()
    return "large-gpu" if large else "gpu"


def default_max_num_batched_tokens(device: torch.device, max_num_seqs: int, usage_context: str) -> int:
    """The budget of the table above for `usage_context` ("llm" or "server"), at least max_num_seqs."""
    return max(_BUDGETS[device_class(device)][usage_context], max_num_seqs)
