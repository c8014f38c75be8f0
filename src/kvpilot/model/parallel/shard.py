"""A rank's model after shard-aware loading (kvpilot.model.parallel.shard_plan): its o_proj and down_proj hold
only the input columns of its heads and MLP width, so their outputs are partial sums; `parallelize` makes
them row-parallel layers that all-reduce, after which every rank holds the same hidden state and logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.model.layers.moe import SparseMoeBlock
from kvpilot.model.parallel.group import TPGroup


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard.T): this rank's input columns; the sum makes every rank's y whole."""

    def __init__(self, weight: nn.Parameter, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight  # the loaded shard itself (layout kept), not a copy
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


def parallelize(model: nn.Module, group: TPGroup) -> None:
    """Turns every layer's o_proj and down_proj (already this rank's columns, bias-free) into row-parallel
    layers over `group`, in place; a mixture-of-experts block all-reduces its output instead."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn.o_proj, RowParallelLinear):
            attn.o_proj = RowParallelLinear(attn.o_proj.weight, group)
        if isinstance(mlp, SparseMoeBlock):  # each expert's down columns: the block's sum is a partial one
            mlp.reduce_output = group.all_reduce
        elif not isinstance(mlp.down_proj, RowParallelLinear):
            mlp.down_proj = RowParallelLinear(mlp.down_proj.weight, group)
