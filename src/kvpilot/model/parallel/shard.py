"""Megatron-style sharding of a loaded Llama-family model over tensor-parallel ranks.

Each rank keeps its share of the attention heads (query heads split evenly; KV heads split too, or, when there
are fewer KV heads than ranks, the one KV head its query heads read, replicated) and of the MLP's intermediate
width: qkv and gate/up are column-parallel (rows of the weight), the output and down projections row-parallel
(columns), followed by one all-reduce each. Embedding, norms and the output layer stay whole on every rank, so
all ranks hold the same hidden state and logits after each layer's reductions.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.parallel.group import TPGroup


def check_tp_split(config: ModelConfig, world_size: int) -> None:
    """ModelLoadError naming the sizes that do not split over `world_size` ranks."""
    heads, kv_heads, width = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    problems = []
    if heads % world_size:
        problems.append(f"{heads} attention heads")
    if kv_heads % world_size and world_size % kv_heads:
        problems.append(f"{kv_heads} KV heads (neither a multiple nor a divisor of it)")
    if width % world_size:
        problems.append(f"an MLP width of {width}")
    if problems:
        divisors = [n for n in range(1, heads + 1) if heads % n == 0 and width % n == 0
                    and (kv_heads % n == 0 or n % kv_heads == 0)]
        raise ModelLoadError(f"tensor_parallel_size={world_size} cannot split {config.name or 'this model'}: "
                             f"{', '.join(problems)}; sizes that work: {', '.join(map(str, divisors))}")


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """What one rank holds: its heads, KV heads and MLP width (the KV cache and `fit` size from this)."""
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world_size,
                               num_key_value_heads=max(1, config.num_key_value_heads // world_size),
                               intermediate_size=config.intermediate_size // world_size)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard.T): this rank's input columns; the sum makes every rank's y whole."""

    def __init__(self, weight: torch.Tensor, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone().contiguous(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                      dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def _head_rows(first: int, count: int, head_dim: int, offset: int = 0) -> slice:
    return slice(offset + first * head_dim, offset + (first + count) * head_dim)


@torch.no_grad()
def shard_model(model: nn.Module, config: ModelConfig, group: TPGroup) -> ModelConfig:
    """Replaces every layer's projections by this rank's shards, in place; returns the rank's config."""
    check_tp_split(config, group.world_size)
    rank, world = group.rank, group.world_size
    local = local_config(config, world)
    heads, kv_heads, dim = local.num_attention_heads, local.num_key_value_heads, config.head_dim
    first_head = rank * heads
    first_kv = rank * kv_heads if config.num_key_value_heads >= world else \
        first_head // (config.num_attention_heads // config.num_key_value_heads)
    q_rows = _head_rows(first_head, heads, dim)
    k_rows = _head_rows(first_kv, kv_heads, dim, config.q_size)
    v_rows = _head_rows(first_kv, kv_heads, dim, config.q_size + config.kv_size)
    width = local.intermediate_size
    gate_rows = slice(rank * width, (rank + 1) * width)
    up_rows = slice(config.intermediate_size + rank * width, config.intermediate_size + (rank + 1) * width)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        bias = None if qkv.bias is None else torch.cat([qkv.bias[q_rows], qkv.bias[k_rows], qkv.bias[v_rows]])
        attn.qkv_proj = _linear(torch.cat([qkv.weight[q_rows], qkv.weight[k_rows], qkv.weight[v_rows]]), bias)
        attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, q_rows], group)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.q_size, attn.kv_size = heads * dim, kv_heads * dim
        gate_up = mlp.gate_up_proj.weight
        mlp.gate_up_proj = _linear(torch.cat([gate_up[gate_rows], gate_up[up_rows]]), None)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, gate_rows], group)
        mlp.intermediate_size = width
    return local
