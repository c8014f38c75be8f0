"""The shared decoder with mixture-of-experts MLPs (Qwen3-MoE, Mixtral): which layers route, their router's
normalisation, the config checks, and the expert weights of a checkpoint stacked into layers.moe's layout.

A family subclasses `MoeDecoderLayer` (its `is_moe_layer` and `renormalize`) and `MoeForCausalLM` (its
`expert_sources`: where its checkpoints keep each layer's router and experts). Checkpoint layouts read, under
each source prefix P (e.g. `layers.3.mlp`):
  - one tensor per expert, as transformers' save_pretrained writes them: P.experts.{j}.{gate,up,down}.weight
    (the family's own three names: Mixtral's w1, w3, w2);
  - transformers 5's fused module tensors: P.experts.gate_up_proj [E, 2I, H] and P.experts.down_proj [E, H, I];
  - GGUF's stacked ones (kvpilot.model.gguf_weights): P.experts.{gate,up,down}_exps.weight [E, I, H] / [E, H, I].
The router is P.gate.weight [E, H]. A layer with some experts' tensors but not all is a ModelLoadError naming
the first missing one; with none at all, load_weights names the missing stacked parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.layers.moe import SparseMoeBlock
from kvpilot.model.models.llama import MLP, DecoderLayer, LlamaForCausalLM, fuse_hf_state_dict

# (gate, up, down) names of one expert's projections in a checkpoint
ExpertNames = tuple[str, str, str]
HF_EXPERT_NAMES: ExpertNames = ("gate_proj", "up_proj", "down_proj")


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is a SparseMoeBlock where `is_moe_layer` says so, a dense MLP elsewhere."""

    @classmethod
    def is_moe_layer(cls, config: ModelConfig, layer_idx: int) -> bool:
        return True

    @classmethod
    def renormalize(cls, config: ModelConfig) -> bool:
        """Whether the top-k router weights are divided by their sum."""
        return True

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if not self.is_moe_layer(config, layer_idx):
            return MLP(config)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, self.renormalize(config))


class MoeForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with MoeDecoderLayer layers; a config without experts is a ModelLoadError."""

    layer_class: type[MoeDecoderLayer] = MoeDecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        self.check_config(config)
        super().__init__(config, max_positions)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """What the family needs beyond the parser's checks (which refuse top-k > experts)."""
        if config.num_experts <= 0 or config.moe_intermediate_size <= 0:
            raise ModelLoadError(f"{config.name or config.architecture}: a {config.architecture} config needs a "
                                 "number of experts (num_experts / num_local_experts) and their width; is this "
                                 "config.json complete?")

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor], source: str) -> None:
        """LlamaForCausalLM.load_weights; an incomplete set of experts is a ModelLoadError naming `source`."""
        try:
            super().load_weights(state, source)
        except ModelLoadError as exc:
            if str(exc).startswith(source):
                raise
            raise ModelLoadError(f"{source}: {exc}") from exc

    def expert_sources(self, layer_idx: int) -> tuple[tuple[str, ExpertNames], ...]:
        """(prefix, per-expert names) where checkpoints keep layer `layer_idx`'s router and experts."""
        return ((f"layers.{layer_idx}.mlp", HF_EXPERT_NAMES),)

    def hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = fuse_hf_state_dict(state, self.config)  # attention and dense layers; expert names pass through
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                for prefix, names in self.expert_sources(i):
                    stack_experts(out, prefix, names, f"layers.{i}.mlp", self.config.num_experts)
        return out


def stack_experts(state: dict[str, torch.Tensor], prefix: str, names: ExpertNames, target: str,
                  num_experts: int) -> None:
    """Moves the router and experts found under `prefix` to target.gate.weight, target.experts.gate_up_proj and
    target.experts.down_proj (in place, popping what it used); leaves `state` as it is when none are there."""
    router = state.pop(f"{prefix}.gate.weight", None)
    if router is not None:
        state[f"{target}.gate.weight"] = router
    experts = f"{prefix}.experts"
    gate_up, down = _per_expert(state, experts, names, num_experts)
    if gate_up is None:
        gate, up = state.pop(f"{experts}.gate_exps.weight", None), state.pop(f"{experts}.up_exps.weight", None)
        if gate is not None and up is not None:
            gate_up, down = torch.cat([gate, up], dim=1), state.pop(f"{experts}.down_exps.weight", None)
        else:
            gate_up, down = state.pop(f"{experts}.gate_up_proj", None), state.pop(f"{experts}.down_proj", None)
    if gate_up is not None:
        state[f"{target}.experts.gate_up_proj"] = gate_up
    if down is not None:
        state[f"{target}.experts.down_proj"] = down


def _per_expert(state: dict[str, torch.Tensor], experts: str, names: ExpertNames,
                num_experts: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gate_up [E, 2I, H], down [E, H, I]) stacked from one tensor per expert; (None, None) when there are none."""
    keys = [[f"{experts}.{j}.{name}.weight" for name in names] for j in range(num_experts)]
    if not any(key in state for row in keys for key in row):
        return None, None
    missing = [key for row in keys for key in row if key not in state]
    if missing:
        raise ModelLoadError(f"missing expert weights: {missing[0]}{' ...' if len(missing) > 1 else ''} "
                             f"({len(missing)} of {3 * num_experts} expert tensors under {experts}): the "
                             "checkpoint is incomplete or has fewer experts than its config's "
                             f"{num_experts}")
    gate_up = torch.stack([torch.cat([state.pop(gate), state.pop(up)]) for gate, up, _ in keys])
    down = torch.stack([state.pop(down_key) for _, _, down_key in keys])
    return gate_up, down
