"""Parameter counts derived from a ModelSpec (never typed in).

Counts follow the Hugging Face module layout: gated MLPs (gate, up, down), untied lm_head counted
separately, MoE router weights, MLA low-rank projections and their norms. The multi-token-prediction
layer of DeepSeek-V3 (`num_nextn_predict_layers`) is not part of the served model and is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.fit.model_spec import ModelSpec


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by role. `matrix` counts are 2-D weights (what quantization shrinks); `vector`
    counts are norms and biases (kept in high precision). Invariant: num_active <= num_total."""

    num_embedding: int
    num_lm_head: int  # 0 when tied to the embedding
    num_attention_matrix: int
    num_dense_mlp_matrix: int  # dense FFN layers plus MoE shared experts
    num_router_matrix: int
    num_expert_matrix: int  # all routed experts, all layers
    num_expert_matrix_active: int  # the top-k routed experts a token uses, all layers
    num_params_per_expert: int  # one routed expert in one layer
    num_moe_layers: int
    num_vector: int

    @property
    def num_total(self) -> int:
        return self.num_embedding + self.num_lm_head + self._num_always_used + self.num_expert_matrix

    @property
    def num_active(self) -> int:
        """Parameters one token touches: what MoE papers call "activated parameters"."""
        return self.num_embedding + self.num_lm_head + self._num_always_used + self.num_expert_matrix_active

    @property
    def num_linear_total(self) -> int:
        """Decoder-layer 2-D weights: the tensors weight quantization applies to."""
        return self.num_attention_matrix + self.num_dense_mlp_matrix + self.num_router_matrix + self.num_expert_matrix

    @property
    def _num_always_used(self) -> int:
        return self.num_attention_matrix + self.num_dense_mlp_matrix + self.num_router_matrix + self.num_vector


def attention_counts(spec: ModelSpec) -> tuple[int, int]:
    """(matrix, vector) parameters of one layer's attention."""
    h, heads, kv, hd = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    if spec.mla is not None:
        m = spec.mla
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q_matrix, q_vector = h * m.q_lora_rank + m.q_lora_rank * heads * qk_dim, m.q_lora_rank
        else:
            q_matrix, q_vector = h * heads * qk_dim, 0
        kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim)  # compressed latent + shared rope key
        kv_matrix = kv_a + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        o_matrix = heads * m.v_head_dim * h
        return q_matrix + kv_matrix + o_matrix, q_vector + m.kv_lora_rank
    matrix = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    vector = (heads * hd + 2 * kv * hd if spec.qkv_bias else 0) + (h if spec.o_bias else 0)
    vector += 2 * hd if spec.qk_norm else 0
    vector += heads if spec.attention_sinks else 0
    return matrix, vector


def count_params(spec: ModelSpec) -> ParamCounts:
    """Exact parameter counts for the architecture (matches the HF checkpoint's tensor sizes)."""
    h, layers = spec.hidden_size, spec.num_hidden_layers
    attn_matrix, attn_vector = attention_counts(spec)
    gated_mlp = 3 * h * spec.intermediate_size
    vector = layers * (attn_vector + spec.norms_per_layer * h) + h  # + final norm
    moe = spec.moe
    if moe is None:
        dense_mlp, router, experts, experts_active, per_expert, moe_layers = layers * gated_mlp, 0, 0, 0, 0, 0
    else:
        moe_layers = layers - moe.num_dense_layers
        per_expert = 3 * h * moe.expert_intermediate_size
        dense_mlp = moe.num_dense_layers * gated_mlp + moe_layers * moe.num_shared_experts * per_expert
        router = moe_layers * h * moe.num_experts
        experts = moe_layers * moe.num_experts * per_expert
        experts_active = moe_layers * moe.num_experts_per_tok * per_expert
        vector += moe_layers * moe.num_experts if moe.has_router_bias else 0
        vector += moe_layers * moe.num_experts * (2 * moe.expert_intermediate_size + h) if moe.has_expert_bias else 0
    embedding = spec.vocab_size * h
    return ParamCounts(
        num_embedding=embedding,
        num_lm_head=0 if spec.tie_word_embeddings else embedding,
        num_attention_matrix=layers * attn_matrix,
        num_dense_mlp_matrix=dense_mlp,
        num_router_matrix=router,
        num_expert_matrix=experts,
        num_expert_matrix_active=experts_active,
        num_params_per_expert=per_expert,
        num_moe_layers=moe_layers,
        num_vector=vector,
    )
