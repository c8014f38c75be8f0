"""Mixtral (MixtralForCausalLM; GGUF: `llama` with an expert count): Mistral's attention (a sliding window
where the config sets one) with a mixture-of-experts MLP in every layer, as transformers builds it.

Every layer routes; the top-k router weights are always renormalised (softmax, top k, divided by their sum).
Experts are `intermediate_size` wide. save_pretrained keeps the router at block_sparse_moe.gate and expert j
at block_sparse_moe.experts.{j}.w1 (gate), w3 (up) and w2 (down); transformers 5's fused tensors and GGUF's
stacked ones sit under mlp (moe_decoder.py lists the layouts).
"""

from __future__ import annotations

from kvpilot.model.models.moe_decoder import HF_EXPERT_NAMES, ExpertNames, MoeDecoderLayer, MoeForCausalLM

MIXTRAL_EXPERT_NAMES: ExpertNames = ("w1", "w3", "w2")


class MixtralForCausalLM(MoeForCausalLM):
    layer_class = MoeDecoderLayer  # every layer routes, renormalised

    def expert_sources(self, layer_idx: int) -> tuple[tuple[str, ExpertNames], ...]:
        return ((f"layers.{layer_idx}.block_sparse_moe", MIXTRAL_EXPERT_NAMES),
                (f"layers.{layer_idx}.mlp", HF_EXPERT_NAMES))
