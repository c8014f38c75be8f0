"""Phi-3 and Phi-4 (HF `Phi3ForCausalLM`: Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini; GGUF `phi3`): the
shared Llama decoder. What differs is met elsewhere or here, by name only:

- The checkpoint stores q/k/v fused as `qkv_proj` and gate/up fused as `gate_up_proj` (gate first): the
  shared decoder's own layout, so weights are renamed, never concatenated. A GGUF stores gate/up as one
  `ffn_up` tensor, read as `mlp.up_proj`.
- LongRoPE (short/long factor per rotary pair, an attention factor on cos/sin) and partial rotary (Phi-4-mini
  rotates the first 3/4 of each head): the config's RopeScaling and rotary_dim, applied by
  kvpilot.model.layers.rope / rope_scaling (the per-position rule for short vs long factors is documented
  there).
- A sliding window on every layer in some configs (Phi-3-mini-4k: 2047): ModelConfig.layer_types, applied by
  the attention backends.
- Residual dropout (`resid_pdrop`) is inert at inference.

Not sharded under tensor parallelism: a rank's q, k and v rows are three ranges of the one stored `qkv_proj`
tensor, and the loaders slice each stored tensor by one index per name (registry: tensor_parallel=False).
"""

from __future__ import annotations

import torch

from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.models.llama import LlamaForCausalLM, fuse_hf_state_dict


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3/Phi-4: the shared decoder with the checkpoint's fused names (see the module docstring)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        activation = config.extra.get("hidden_act", "silu")
        if activation != "silu":  # the shared MLP computes silu(gate) * up
            raise ModelLoadError(f"{config.name or 'Phi3ForCausalLM'}: hidden_act {activation!r} is not "
                                 "supported for Phi-3 models (kvpilot runs 'silu')")
        super().__init__(config, max_positions)

    def hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names -> this module's: `model.` dropped (qkv_proj and gate_up_proj are already fused); a
        GGUF's fused `mlp.up_proj` [2 * intermediate, hidden] becomes gate_up_proj. Checkpoints that store
        q/k/v or gate/up apart are fused as the shared decoder fuses them."""
        renamed = dict(state)
        for i in range(self.config.num_hidden_layers):
            prefix = f"model.layers.{i}.mlp"
            if f"{prefix}.up_proj.weight" in renamed and f"{prefix}.gate_proj.weight" not in renamed:
                renamed[f"{prefix}.gate_up_proj.weight"] = renamed.pop(f"{prefix}.up_proj.weight")
        return fuse_hf_state_dict(renamed, self.config)
