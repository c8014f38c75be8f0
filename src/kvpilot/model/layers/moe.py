"""Mixture of experts: a top-k softmax router and experts held as stacked tensors, computed grouped.

`SparseMoeBlock` (router `gate` [E, H] + `experts`) replaces a decoder layer's MLP. The router takes the
softmax over all experts in float32, keeps the top k and, where the family says so (`renormalize`: Mixtral
always, Qwen3-MoE with `norm_topk_prob`), divides them by their sum. `Experts` holds every expert's gate and
up projections as one [E, 2*I, H] tensor (gate rows first, then up) and the down projections as [E, H, I].

The experts are computed grouped, never token by token: the (token, expert) pairs are sorted by expert, each
expert that some token chose runs one GEMM pair over all of its tokens, and each result row, scaled by its
router weight, is added into its token's float32 output row, experts in increasing order (transformers'
order, so float32 sums match it bit for bit). A batch-1 decode step reads only its top-k experts' weights.
CUDA tensors take the fused Triton kernels (layers/triton_moe.py, no host sync, so CUDA graphs capture
them). bf16 on CPU (`prepack_experts`) takes the C++ kernel (layers/cpu_moe_kernel.py: two parallel regions a
layer, not two per expert); a CPU without AVX512_BF16 runs each expert's GEMMs on weights prepacked for oneDNN.

Families that differ (gpt-oss: layers/moe_variants.py) override `SparseMoeBlock.route` and give `Experts` a bias
per expert output and their own gated activation; such experts run the Triton kernels on CUDA (which add the
biases and compute that activation) and the grouped torch path on CPU, oneDNN-prepacked in bf16 (the C++
kernel computes neither biases nor another activation). The default experts' paths are unchanged by them.

A quantized GGUF's experts take quant/packed_experts.PackedExperts in place of `Experts` (same forward: x, router
weights, ids), which computes them on the packed blocks, grouped the same way.

Invariants: 0 < top_k <= num_experts; the output has x's shape and dtype.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.model.layers.cpu_bf16_ops import bf16_ops_for
from kvpilot.model.layers.cpu_moe_kernel import moe_kernel_for
from kvpilot.model.layers.gpu_small_ops import small_ops_for
from kvpilot.model.layers.moe_variants import ClampedSwiGLU
from kvpilot.model.layers.onednn_linear import OneDnnWeight, onednn_bf16_applies


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E]: softmax in float32, top k
    (torch.topk's order and ties), divided by their sum when `renormalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [N, 2*I] rows (gate first), as llama.MLP computes it (C++ for bf16 on CPU, Triton on
    CUDA, torch elsewhere)."""
    ops = bf16_ops_for(gate_up)
    if ops is not None:
        return ops.silu_mul_bf16(gate_up)
    gpu = small_ops_for(gate_up) if gate_up.stride(-1) == 1 else None
    if gpu is not None:
        return gpu.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                    expert_fn: ExpertFn) -> torch.Tensor:
    """sum_j weights[t, j] * expert_fn(ids[t, j], x[t]) for every token t, one expert_fn call per expert hit
    (on all of its rows at once), summed in float32 in increasing expert order; returns x's dtype.
    Reads the expert counts on the host (one sync): the CPU path and eager CUDA without Triton."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order within each
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // top_k
    scales = weights.reshape(-1)[order].unsqueeze(1)
    # each pair's weighted row at its sorted place, then one scatter-add for all (on CPU each scatter is a parallel
    # region: one per expert cost a busy 2-vCPU machine as much as the experts' GEMMs)
    rows = torch.empty(flat.numel(), x.shape[-1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        part = slice(start, start + count)
        start += count
        inputs = x if num_tokens == 1 else x.index_select(0, tokens[part])
        torch.mul(expert_fn(expert, inputs), scales[part], out=rows[part])
    if num_tokens == 1:  # k small adds in expert order (index_add_ runs a parallel region for k rows)
        out = rows[0:1].clone()
        for j in range(1, top_k):
            out += rows[j:j + 1]
        return out.to(x.dtype)
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, rows).to(x.dtype)


@lru_cache(maxsize=1)
def _triton_moe() -> Any | None:
    if importlib.util.find_spec("triton") is None:
        return None
    from kvpilot.model.layers import triton_moe  # imports triton
    return triton_moe


class Experts(nn.Module):
    """Every expert's SwiGLU MLP: gate_up_proj [E, 2*I, H] (gate rows, then up rows), down_proj [E, H, I];
    with `bias`, gate_up_proj_bias [E, 2*I] and down_proj_bias [E, H] added to each GEMM's output; with
    `activation` (gpt-oss's ClampedSwiGLU), that instead of silu(gate) * up.

    `prepack` readies them for the CPU: bf16 with the C++ kernel keeps them (`cpu_kernel` set); bf16 without it
    replaces them (None) by each expert's projections as OneDnnWeight (`packed`): the same products as F.linear,
    without its per-call reorder of the weight."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 activation: ClampedSwiGLU | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        self.activation = activation
        self.variant = bias or activation is not None  # not the default experts: forward_variant computes them
        self.packed: list[tuple[OneDnnWeight, OneDnnWeight]] | None = None
        self.cpu_kernel: Any | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], router weights float32 [T, k], expert ids [T, k] -> [T, H] in x's dtype."""
        if self.variant:
            return self.forward_variant(x, weights, ids)
        if self.cpu_kernel is not None and x.dtype == torch.bfloat16:
            return self.cpu_kernel.moe_experts_bf16(x.contiguous(), self.gate_up_proj, self.down_proj,
                                                    weights.contiguous(), ids.contiguous())
        if self.packed is not None:
            return grouped_experts(x, weights, ids, self.num_experts, self._packed_expert)
        triton_moe = _triton_moe() if x.is_cuda else None
        if triton_moe is not None:
            return triton_moe.fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids)
        return grouped_experts(x, weights, ids, self.num_experts, self._dense_expert)

    def _dense_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_mul(F.linear(rows, self.gate_up_proj[expert])), self.down_proj[expert])

    def _packed_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.packed[expert]  # type: ignore[index]
        return down.linear(silu_mul(gate_up.linear(rows)))

    def forward_variant(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """forward() of experts with biases or another activation: Triton on CUDA, grouped torch elsewhere."""
        triton_moe = _triton_moe() if x.is_cuda else None
        if triton_moe is not None:
            return triton_moe.fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids,
                                            gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                                            activation=self.activation)
        expert = self._packed_variant_expert if self.packed is not None else self._variant_expert
        return grouped_experts(x, weights, ids, self.num_experts, expert)

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up) if self.activation is None else self.activation(gate_up)

    def _variant_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        # bias added after the product, as transformers adds it (F.linear's fused bias sums in another order)
        gate_up = F.linear(rows, self.gate_up_proj[expert])
        if self.gate_up_proj_bias is not None:
            gate_up += self.gate_up_proj_bias[expert]
        out = F.linear(self._activate(gate_up), self.down_proj[expert])
        return out if self.down_proj_bias is None else out.add_(self.down_proj_bias[expert])

    def _packed_variant_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.packed[expert]  # type: ignore[index]
        gate_up_bias, down_bias = ((None, None) if self.gate_up_proj_bias is None
                                   else (self.gate_up_proj_bias[expert], self.down_proj_bias[expert]))
        return down.linear(self._activate(gate_up.linear(rows, gate_up_bias)), down_bias)

    @torch.no_grad()
    def prepack(self) -> bool:
        """bf16 on a CPU with the C++ kernel (default experts only): the weights kept as they are (contiguous),
        the kernel noted (True). bf16 on a oneDNN CPU without it (or with variant experts): each expert's
        weights into oneDNN's layout, the dense copies freed (True). Other float CPU weights: each expert's
        matrices re-laid [in, out] (weight_layout.py's reason: a plain B for the BLAS), values unchanged
        (False)."""
        weight = self.gate_up_proj
        if weight is None or weight.device.type != "cpu":
            return False
        self.cpu_kernel = None if self.variant else moe_kernel_for(weight)
        if self.cpu_kernel is not None:
            for param in (self.gate_up_proj, self.down_proj):
                param.data = param.data.contiguous()  # the kernel reads the plain layout
            return True
        if not onednn_bf16_applies(weight.dtype, weight.device):
            for param in (self.gate_up_proj, self.down_proj):
                param.data = param.data.transpose(1, 2).contiguous().transpose(1, 2)
            return False
        self.packed = [(OneDnnWeight(self.gate_up_proj[e]), OneDnnWeight(self.down_proj[e]))
                       for e in range(self.num_experts)]
        self.gate_up_proj = None  # type: ignore[assignment]
        self.down_proj = None  # type: ignore[assignment]
        return True


class SparseMoeBlock(nn.Module):
    """Router `gate` + `experts`: the MLP of a mixture-of-experts layer, [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in 1..{num_experts} (the number of experts)")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        # tensor parallelism (parallel/shard.py): the all-reduce summing the ranks' shares of every expert
        self.reduce_output: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(rows)
        out = self.experts(rows, weights, ids)
        return (out if self.reduce_output is None else self.reduce_output(out)).view(x.shape)

    def route(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], expert ids [T, k]) for rows [T, H] (a family that routes otherwise
        overrides this: gpt-oss)."""
        return route(self.gate(rows), self.top_k, self.renormalize)


def prepack_experts(model: nn.Module) -> int:
    """Experts.prepack on every Experts module of `model`; returns how many took a bf16 CPU path."""
    return sum(module.prepack() for module in model.modules() if isinstance(module, Experts))
