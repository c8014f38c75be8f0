"""Which CUDA graphs an engine captures, what they take out of the KV budget, and the capture itself.

`--compilation-config`'s cudagraph_mode (model/compilation_config.py; `--enforce-eager` is NONE) chooses the
kinds: decode graphs (model/cuda_graphs.py: the whole forward of a decode-only step, Triton attention, one
block table a step) and piecewise graphs (model/piecewise_graphs.py: every other step up to the largest
bucket, attention run eagerly between the pieces, so any backend and KV groups). Graphs are captured after
the KV cache is allocated, so their memory is set aside from the KV budget first; a capture that fails is
logged and the engine serves those steps eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvpilot.launch.args import EngineArgs
from kvpilot.model.attention.triton_support import triton_unusable_reason
from kvpilot.model.choices import cuda_graph_sizes
from kvpilot.model.config import ModelConfig
from kvpilot.model.loader import LoadedModel
from kvpilot.model.runner import ModelRunner

logger = logging.getLogger("kvpilot")
# set aside from the KV budget per captured decode graph: ~35 MiB a size measured on an H200 with a warm-up
# stream per size (docs/benchmark-log.md; one stream for all now: expected lower, not yet measured)
CUDA_GRAPH_BYTES_PER_SIZE = 40 * 2**20
# piecewise graphs share one pool, which holds the largest bucket's activations (twice the estimate of
# piecewise_pool_bytes, for the allocator's rounding), plus this per graph (not yet measured on a GPU)
PIECEWISE_BYTES_PER_GRAPH = 64 * 2**10


@dataclass(frozen=True)
class GraphPlan:
    """The graphs an engine captures: decode batch sizes and piecewise token counts (empty: none of that kind),
    and why a kind the mode asked for is off (logged at capture)."""

    decode_sizes: tuple[int, ...] = ()
    piecewise_sizes: tuple[int, ...] = ()
    off_reasons: tuple[str, ...] = ()

    def set_aside_bytes(self, config: ModelConfig, dtype_bytes: int) -> int:
        """What the graphs take from the device after the KV cache is allocated."""
        pieces = piecewise_pool_bytes(config, dtype_bytes, max(self.piecewise_sizes)) + \
            PIECEWISE_BYTES_PER_GRAPH * len(self.piecewise_sizes) * (config.num_hidden_layers + 1) \
            if self.piecewise_sizes else 0
        return CUDA_GRAPH_BYTES_PER_SIZE * len(self.decode_sizes) + pieces


def piecewise_pool_bytes(config: ModelConfig, dtype_bytes: int, num_tokens: int) -> int:
    """Twice the activations a layer keeps at once for num_tokens rows: the residual, the normed input and the
    MLP's output (hidden each), q/k/v and attention's output, gate/up and their product (the experts' for MoE)."""
    intermediate = max(config.intermediate_size, config.moe_intermediate_size * config.num_experts_per_tok)
    per_token = 3 * config.hidden_size + 2 * config.q_size + 2 * config.kv_size + 3 * intermediate
    return 2 * per_token * dtype_bytes * num_tokens


def graph_plan(args: EngineArgs, loaded: LoadedModel, kv_dtype: torch.dtype, max_num_batched_tokens: int,
               *, hybrid: bool) -> GraphPlan:
    """The graphs `args` asks for that this engine can capture (hybrid: the model's layers read several
    block tables, engine/kv_groups.py)."""
    compilation = args.compilation
    if loaded.device.type != "cuda" or args.enforce_eager or compilation.cudagraph_mode == "NONE":
        return GraphPlan()
    speculative = args.speculative
    if speculative is not None and speculative.method in ("eagle", "eagle3"):
        return GraphPlan(off_reasons=("the EAGLE head reads the target's aux layers, which a graph does not "
                                      "leave",))
    if args.tensor_parallel_size > 1:
        return GraphPlan(off_reasons=("tensor parallelism: the ranks' NCCL all-reduces are not captured yet",))
    reasons = []
    decode: tuple[int, ...] = ()
    if compilation.full_decode:
        if args.attention_backend not in ("auto", "triton") or \
                triton_unusable_reason(loaded.device, loaded.dtype, kv_dtype) is not None:
            reasons.append(f"decode graphs need the triton attention backend (not {args.attention_backend})")
        elif hybrid:
            reasons.append("decode graphs replay one block table a step, and this model's layers read several "
                           "(KV groups)")
        else:
            decode = tuple(cuda_graph_sizes(args.max_num_seqs, args.cuda_graph_sizes or
                                            compilation.cudagraph_capture_sizes))
    pieces = tuple(compilation.piecewise_sizes(max_num_batched_tokens)) if compilation.piecewise else ()
    return GraphPlan(decode, pieces, tuple(reasons))


def capture_graphs(runner: ModelRunner, plan: GraphPlan, max_num_batched_tokens: int) -> None:
    """Captures the plan's graphs into `runner`; a failure is logged and those steps run eagerly."""
    for reason in plan.off_reasons:
        logger.info("CUDA graphs off for some steps: %s", reason)
    if plan.decode_sizes and runner.attention.name != "triton":  # auto chose another backend for this model
        logger.info("CUDA graphs off for decode steps: the %s attention backend builds per-step metadata a "
                    "graph cannot replay", runner.attention.name)
    elif plan.decode_sizes:
        try:
            runner.capture_decode_graphs(plan.decode_sizes, max_num_batched_tokens)
        except RuntimeError as exc:  # serve eagerly rather than not at all; the log says why
            runner.graphs = None
            logger.warning("CUDA graph capture failed, decode steps run eagerly (--enforce-eager skips the "
                           "capture): %s", exc)
    if plan.piecewise_sizes:
        try:
            runner.capture_piecewise_graphs(plan.piecewise_sizes)
        except RuntimeError as exc:
            runner.piecewise = None
            logger.warning("piecewise CUDA graph capture failed, steps with prompt tokens run eagerly "
                           "(--compilation-config '{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}' skips it): %s", exc)
