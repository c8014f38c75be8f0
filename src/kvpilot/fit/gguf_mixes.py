"""llama.cpp's quantization mixes (Q4_K_M, Q5_K_S, Q8_0, ...) for a model without a GGUF file: which type each
tensor gets, so `fit --weight-dtype q4_k_m` sizes a catalog model tensor by tensor, as a file of that mix.

The types follow llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp) for the mixes below:
- every matrix takes the mix's base type (Q4_K for Q4_K_S/M, Q5_K for Q5_K_S/M, Q6_K, Q8_0, Q4_0 ...);
- the output head (the embedding when tied) Q6_K, or Q8_0 for the Q8_0 mix and for rows that are not whole blocks
  of the base type;
- Q4_K_M / Q5_K_M: attn_v and ffn_down Q6_K in the "more bits" layers (the first and last eighth, and every
  third between); Q4_K_S: attn_v Q5_K in the first 4 layers, ffn_down Q5_K in the first eighth;
- 80-layer models (llama.cpp's 70B type): a Q4_K attn_v becomes Q5_K; 8-expert models: attn_v and attn_k Q8_0,
  attn_output Q5_K for Q4_K_S/M;
- a K-quant row that is not whole 256-value super-blocks falls back to Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0;
- norms, biases and the MoE router stay F32.
Bits a weight then follow from the block layouts (`gguf.GGML_QUANT_SIZES`: Q4_K 144 bytes per 256 values, Q6_K 210,
Q8_0 34 per 32 ...): Q4_K_M is about 4.85 bits a weight on a Llama-2-7B shape (half its attn_v and ffn_down in Q6_K,
the head Q6_K), 4.89 on Llama-3.1-8B, more on small models where the head weighs more. MLA attention (DeepSeek)
is sized as one matrix of the base type.
"""

from __future__ import annotations

from kvpilot.fit.gguf_sizes import GgufTensor
from kvpilot.fit.model_spec import ModelSpec
from kvpilot.fit.params import attention_counts

BASE_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q8_0": "Q8_0", "q4_k_s": "Q4_K",
              "q4_k_m": "Q4_K", "q5_k_s": "Q5_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K"}
MIXES = tuple(k for k in BASE_TYPES if k.count("_") == 2)  # the names that are mixes, not single types
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _block(type_name: str) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer_type(mix: str, part: str, i: int, spec: ModelSpec) -> str:
    """The type of layer i's matrix `part` (attn_v, ffn_down_exps, ...) before the row-width fallback."""
    base, n = BASE_TYPES[mix], spec.num_hidden_layers
    experts = spec.moe.num_experts if spec.moe is not None else 0
    kind = part.removesuffix("_exps").removesuffix("_shexp")
    new = base
    if kind == "attn_v":
        if mix in ("q4_k_m", "q5_k_m") and _more_bits(i, n):
            new = "Q6_K"
        elif mix == "q4_k_s" and i < 4:
            new = "Q5_K"
        new = "Q5_K" if n == 80 and new == "Q4_K" else new
        new = "Q8_0" if experts == 8 else new
    elif kind == "attn_k" and experts == 8:
        new = "Q8_0"
    elif kind == "ffn_down":
        if mix in ("q4_k_m", "q5_k_m") and _more_bits(i, n):
            new = "Q6_K"
        elif mix == "q4_k_s" and i < n // 8:
            new = "Q5_K"
    elif kind == "attn_output" and experts == 8 and mix in ("q4_k_s", "q4_k_m"):
        new = "Q5_K"
    return new


def _fit_rows(type_name: str, cols: int) -> str:
    """llama.cpp's fallback for rows that are not whole blocks of the type."""
    if cols % _block(type_name)[0]:
        type_name = _FALLBACK.get(type_name, "F16")
    return type_name if cols % _block(type_name)[0] == 0 else "F16"


def _tensor(name: str, type_name: str, rows: int, cols: int) -> GgufTensor:
    values, size = _block(type_name)
    return GgufTensor(name, type_name, rows * cols, rows * cols // values * size, rows, cols)


def _layer_matrices(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """(part, rows, cols) of one decoder layer's attention matrices."""
    h, d = spec.hidden_size, spec.head_dim
    if spec.mla is not None:
        return [("attn_mla", attention_counts(spec)[0] // h, h)]
    return [("attn_q", spec.num_attention_heads * d, h), ("attn_k", spec.num_key_value_heads * d, h),
                     ("attn_v", spec.num_key_value_heads * d, h), ("attn_output", h, spec.num_attention_heads * d)]


def _ffn_matrices(spec: ModelSpec, i: int) -> list[tuple[str, int, int]]:
    h, moe = spec.hidden_size, spec.moe
    if moe is None or i < moe.num_dense_layers:  # dense layers first, as DeepSeek's first_k_dense_replace
        inter = spec.intermediate_size
        return [("ffn_gate", inter, h), ("ffn_up", inter, h), ("ffn_down", h, inter)]
    e, inter = moe.num_experts, moe.expert_intermediate_size
    out = [("ffn_gate_exps", e * inter, h), ("ffn_up_exps", e * inter, h), ("ffn_down_exps", e * h, inter)]
    if moe.num_shared_experts:
        shared = inter * moe.num_shared_experts
        out += [("ffn_gate_shexp", shared, h), ("ffn_up_shexp", shared, h), ("ffn_down_shexp", h, shared)]
    return out


def mix_tensors(spec: ModelSpec, mix: str, head: str | None = None) -> tuple[GgufTensor, ...]:
    """The tensors a llama.cpp `mix` file of this model holds (vectors F32), with their types and bytes; `head`:
    the output head's type instead of the mix's."""
    base, h = BASE_TYPES[mix], spec.hidden_size
    head = head or ("Q8_0" if h % _block(base)[0] or base == "Q8_0" else "Q6_K")
    embedding = _fit_rows(head if spec.tie_word_embeddings else base, h)
    out = [_tensor("token_embd.weight", embedding, spec.vocab_size, h), _tensor("output_norm.weight", "F32", 1, h)]
    if not spec.tie_word_embeddings:
        out.append(_tensor("output.weight", _fit_rows(head, h), spec.vocab_size, h))
    for i in range(spec.num_hidden_layers):
        for part, rows, cols in _layer_matrices(spec) + _ffn_matrices(spec, i):
            out.append(_tensor(f"blk.{i}.{part}.weight", _fit_rows(_layer_type(mix, part, i, spec), cols), rows, cols))
        if spec.moe is not None and i >= spec.moe.num_dense_layers:
            out.append(_tensor(f"blk.{i}.ffn_gate_inp.weight", "F32", spec.moe.num_experts, h))
        out.append(_tensor(f"blk.{i}.norms", "F32", 1, _num_vector(spec)))
    return tuple(out)


def _num_vector(spec: ModelSpec) -> int:
    """Norm and bias values of one layer (params.py's count over the layers)."""
    return attention_counts(spec)[1] + spec.norms_per_layer * spec.hidden_size


def file_bits_per_weight(tensors: tuple[GgufTensor, ...]) -> float:
    return 8 * sum(t.num_bytes for t in tensors) / sum(t.num_elements for t in tensors)
