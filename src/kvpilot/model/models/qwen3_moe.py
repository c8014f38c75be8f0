"""Qwen3-MoE (Qwen3MoeForCausalLM, GGUF `qwen3moe`): Qwen3's attention (q/k RMSNorm) with mixture-of-experts
MLPs, as transformers builds it.

Layer i routes when it is not in `mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step`; the
other layers keep a dense MLP of `intermediate_size`. Experts are `moe_intermediate_size` wide; the top-k
router weights are renormalised only with `norm_topk_prob` (transformers' default: false). The checkpoint
keeps the router at mlp.gate and the experts at mlp.experts.{j}.{gate,up,down}_proj.
"""

from __future__ import annotations

from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.models.moe_decoder import MoeDecoderLayer, MoeForCausalLM


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    @classmethod
    def is_moe_layer(cls, config: ModelConfig, layer_idx: int) -> bool:
        dense = config.extra.get("mlp_only_layers") or ()
        step = int(config.extra.get("decoder_sparse_step") or 1)
        return layer_idx not in dense and (layer_idx + 1) % step == 0

    @classmethod
    def renormalize(cls, config: ModelConfig) -> bool:
        return bool(config.extra.get("norm_topk_prob", False))


class Qwen3MoeForCausalLM(MoeForCausalLM):
    layer_class = Qwen3MoeDecoderLayer

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        source = config.name or config.architecture
        # transformers' defaults for these (128 experts, 768 wide) differ from the parser's fallbacks: a config
        # without them would load as a different model than transformers builds
        # (transformers 5 writes the expert count as num_local_experts)
        for keys in (("num_experts", "num_local_experts"), ("moe_intermediate_size",)):
            if all(config.extra.get(key) is None for key in keys):
                raise ModelLoadError(f"{source}: a Qwen3-MoE config needs '{keys[0]}'; is this config.json "
                                     "complete?")
        step = config.extra.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ModelLoadError(f"{source}: decoder_sparse_step must be a positive integer, got {step!r}")
