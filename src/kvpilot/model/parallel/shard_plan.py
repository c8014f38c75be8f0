"""Which part of each weight one tensor-parallel rank keeps, by name: the loaders read only that part.

Megatron-style: a rank keeps its query heads (split evenly), its KV heads (split too, or, when there are fewer
KV heads than ranks, the one its query heads read, replicated), and its share of the MLP's intermediate width.
q/k/v and gate/up are column-parallel (the rank's output rows), o_proj and down_proj row-parallel (the
matching input columns, summed over the ranks by one all-reduce each). Embedding, norms and the output layer
stay whole on every rank. Mixture-of-experts layers split every expert the same way: a rank holds each
expert's share of the expert width (gate/up rows, down columns) and the whole router, so every rank routes
alike, and the block's output is all-reduced once.

Invariant: every loader (safetensors, GGUF, dummy) gives a rank exactly `take` (HF names) or `take_fused`
(kvpilot's fused names) of the tensor the one-rank model holds, so TP outputs equal TP=1's; the whole tensor
is held at most one at a time (GGUF's dequantized rows, a dummy draw), never the whole model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError

ALL = slice(None)


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
    if config.moe_intermediate_size % world_size:
        problems.append(f"an expert width of {config.moe_intermediate_size}")
    if problems:
        divisors = [n for n in range(1, heads + 1) if heads % n == 0 and width % n == 0
                    and config.moe_intermediate_size % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
        raise ModelLoadError(f"tensor_parallel_size={world_size} cannot split {config.name or 'this model'}: "
                             f"{', '.join(problems)}; sizes that work: {', '.join(map(str, divisors))}")


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """What one rank holds: its heads, KV heads, MLP and expert widths (the KV cache and `fit` size from this)."""
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world_size,
                               num_key_value_heads=max(1, config.num_key_value_heads // world_size),
                               intermediate_size=config.intermediate_size // world_size,
                               moe_intermediate_size=config.moe_intermediate_size // world_size)


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world_size`: its rows of q_proj (`q_rows`), of k_proj and v_proj (`kv_rows`), of
    gate_proj and up_proj (`mlp_rows`) and of each expert's gate and up (`expert_rows`); o_proj and the down
    projections keep the same ranges as columns."""

    rank: int
    world_size: int
    config: ModelConfig  # the whole model's
    q_rows: slice
    kv_rows: slice
    mlp_rows: slice
    expert_rows: slice

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
        """Raises ModelLoadError (naming the sizes that work) when the model does not split."""
        check_tp_split(config, world_size)
        if not 0 <= rank < world_size:
            raise ModelLoadError(f"tensor-parallel rank {rank} is outside 0..{world_size - 1}")
        local = local_config(config, world_size)
        heads, kv_heads, dim = local.num_attention_heads, local.num_key_value_heads, config.head_dim
        first_head = rank * heads
        first_kv = rank * kv_heads if config.num_key_value_heads >= world_size else \
            first_head // (config.num_attention_heads // config.num_key_value_heads)
        width, expert_width = local.intermediate_size, local.moe_intermediate_size
        return cls(rank, world_size, config, slice(first_head * dim, (first_head + heads) * dim),
                   slice(first_kv * dim, (first_kv + kv_heads) * dim), slice(rank * width, (rank + 1) * width),
                   slice(rank * expert_width, (rank + 1) * expert_width))

    @property
    def local_config(self) -> ModelConfig:
        return local_config(self.config, self.world_size)

    def index(self, name: str) -> tuple[slice, ...] | None:
        """The rank's index into the HF-named tensor `name` (rows, or (all rows, columns)); None: all of it."""
        if ".experts." in name:
            return self._expert_index(name)
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in _HF_INDEX:
            return None
        return _HF_INDEX[parts[-2]](self, parts[-1])

    def _expert_index(self, name: str) -> tuple[slice, ...]:
        """An expert tensor's rank part (moe_decoder.py's layouts): one expert's gate/up rows or down columns,
        GGUF's stacked [E, I, H] / [E, H, I], transformers 5's stacked down [E, H, I]."""
        rows, parts = self.expert_rows, name.split(".")
        if parts[-1] == "gate_up_proj":  # gate and up halves of one tensor: no single slice takes a rank's part
            raise ModelLoadError(f"{name}: tensor parallelism reads experts stored one tensor per expert (as "
                                 "save_pretrained writes them) or as GGUF; this checkpoint fuses gate and up: "
                                 "use --tensor-parallel-size 1")
        if parts[-1] == "down_proj" or parts[-2] == "down_exps":
            return ALL, ALL, rows
        if parts[-2] in ("gate_exps", "up_exps"):
            return ALL, rows
        return (ALL, rows) if parts[-2] in ("down_proj", "w2") else (rows,)

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part of HF-named `tensor`, in memory of its own (the whole one can be freed)."""
        index = self.index(name)
        return tensor if index is None else tensor[index].clone()

    def take_fused(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part of a tensor named as the model's parameters (q/k/v and gate/up fused)."""
        config, kind = self.config, name.split(".")[-1]
        if ".self_attn.qkv_proj." in name:
            q, k, v = tensor.split([config.q_size, config.kv_size, config.kv_size])
            return torch.cat([q[self.q_rows], k[self.kv_rows], v[self.kv_rows]])
        if ".mlp.gate_up_proj." in name:
            gate, up = tensor.split(config.intermediate_size)
            return torch.cat([gate[self.mlp_rows], up[self.mlp_rows]])
        if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: each expert's gate rows, then its up rows
            gate, up = tensor.split(config.moe_intermediate_size, dim=1)
            return torch.cat([gate[:, self.expert_rows], up[:, self.expert_rows]], dim=1)
        if name.endswith(".experts.down_proj"):
            return tensor[:, :, self.expert_rows].clone()
        return self.take(name, tensor) if kind == "weight" else tensor

    def full_shape(self, name: str, local_shape: torch.Size) -> tuple[int, ...]:
        """The whole model's shape of the parameter `name` whose shape on this rank is `local_shape`."""
        config, shape = self.config, list(local_shape)
        if ".self_attn.qkv_proj." in name:
            shape[0] = config.q_size + 2 * config.kv_size
        elif ".mlp.gate_up_proj." in name:
            shape[0] = 2 * config.intermediate_size
        elif name.endswith(".self_attn.o_proj.weight"):
            shape[1] = config.q_size
        elif name.endswith(".mlp.down_proj.weight"):
            shape[1] = config.intermediate_size
        elif name.endswith(".experts.gate_up_proj"):
            shape[1] = 2 * config.moe_intermediate_size
        elif name.endswith(".experts.down_proj"):
            shape[2] = config.moe_intermediate_size
        return tuple(shape)


# HF projection name -> the rank's index for its weight or bias (row-parallel layers have no bias here)
_HF_INDEX = {
    "q_proj": lambda plan, kind: (plan.q_rows,),
    "k_proj": lambda plan, kind: (plan.kv_rows,),
    "v_proj": lambda plan, kind: (plan.kv_rows,),
    "gate_proj": lambda plan, kind: (plan.mlp_rows,),
    "up_proj": lambda plan, kind: (plan.mlp_rows,),
    "o_proj": lambda plan, kind: (ALL, plan.q_rows) if kind == "weight" else None,
    "down_proj": lambda plan, kind: (ALL, plan.mlp_rows) if kind == "weight" else None,
}
