"""What kvpilot holds in memory for a GGUF file's tensors, tensor by tensor (torch-free: the loader's rules).

As kvpilot's loader decides (model/loader.py, model/quant/model_pack.py):
- packed: on a CPU, for a family the packed kernels run (PACKED_FAMILIES), when every linear weight (decoder
  matrices and the output head) is of a type the kernels compute on (PACKED_TYPES). Each such tensor keeps its
  GGUF blocks, 8 * type_size / block_size bits a weight (block layouts from `gguf.GGML_QUANT_SIZES`). With bf16
  activations the int8 path holds a column-tiled copy instead (model/quant/vnni_gemm.py, tiled_kquant.py), the
  same bytes (Q4_0's and Q8_0's offsets, -8 d and -128 d, are derived, not stored) except that the 6-bit sub-block
  scales (and minimums) take a byte each:
  Q4_K 148 bytes per 256 values (4.625 bits; the block: 144, 4.5), Q5_K 180 (5.625; 176, 5.5), IQ4_XS 138 (4.3125;
  136, 4.25), and MXFP4's exponent byte becomes a float16 scale (18 bytes per 32 values; the block: 17); Q4_1, Q5_0,
  Q5_1, Q6_K and IQ4_NL keep their blocks' bytes.
  The embedding table is held dense in the compute dtype for token lookups; a tied output head keeps a packed
  copy of the embedding's blocks beside it. Norms, biases and MoE routers: the compute dtype. Routed experts
  (ffn_{gate,up,down}_exps, or older Mixtral files' ffn_{gate,up,down}.E) are linear weights like the others:
  packed the same way (model/quant/packed_experts.py: their blocks, or with bf16 activations one tiled int8 copy per
  stacked tensor), never with a dense copy.
- experts packed: for gpt-oss on a CPU (PACKED_EXPERT_FAMILIES), the routed experts as their blocks when all are of
  packed types, every other weight dequantized.
- dequantized: otherwise (a GPU, another family, one linear weight of a type without a kernel, e.g. Q3_K or
  IQ3_S) the whole model is dequantized at load: every weight takes the compute dtype, 16 bits in bf16,
  whatever the file stores.
Not counted: the hybrid layout's dense copies for many-row GEMMs (`--quantization auto` with bf16 activations,
when they fit in a quarter of the free memory); `--quantization gguf` holds the packed weights only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpilot.fit.gguf_sizes import GgufTensor

# GGUF type -> bytes its column-tiled int8 copy adds per block (the K-quants' 12 bytes of packed 6-bit scales and
# minimums become 16, IQ4_XS's 6 bytes of 6-bit scales 8; MXFP4's exponent byte a float16); the set equals
# kvpilot.model.quant.formats.PACKED_FORMATS (tests/fit check)
PACKED_TYPES: dict[str, int] = {"Q8_0": 0, "Q4_0": 0, "Q4_1": 0, "Q5_0": 0, "Q5_1": 0, "Q4_K": 4, "Q5_K": 4,
                                "Q6_K": 0, "IQ4_NL": 0, "MXFP4": 1, "IQ4_XS": 2}
# HF model types whose GGUF weights stay packed (model/models/registry.py `packed_gguf`; tests/fit check it)
PACKED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"})
# HF model types whose routed experts alone stay packed (registry `packed_gguf_experts`): their blocks, on the float32
# kernel (no int8 copies: the grouped kernel has no expert biases), every other weight dequantized
PACKED_EXPERT_FAMILIES = frozenset({"gpt_oss"})
TILE_ROWS = 16  # the tiled copy takes whole 16-row tiles; other layers keep the file's blocks
# the types with int8 copies by the CPU's int8 path (fingerprint.cpu_int8_path): AVX-512 VNNI and AVX2 take every
# type (model/quant/tiled_set.int8_copy)
INT8_COPY_TYPES = {"vnni": frozenset(PACKED_TYPES), "avx2": frozenset(PACKED_TYPES), "none": frozenset()}
EMBEDDING, OUTPUT = "token_embd.weight", "output.weight"
_LINEAR = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_qkv|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
_EXPERTS = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)(_exps|\.\d+)\.weight$")


@dataclass(frozen=True)
class HeldGguf:
    """Bytes kvpilot holds for a GGUF's tensors, by role. Invariant: all >= 0; num_bytes_lm_head is the packed
    copy of a tied embedding when packed, 0 for a tied head held dequantized (it reads the embedding table)."""

    num_bytes_embedding: int
    num_bytes_lm_head: int
    num_bytes_layers: int
    packed: bool
    reason: str  # why the weights are held this way, for the report's notes
    # the routed experts' share of num_bytes_layers, and their weights' count (0, 0: a dense model)
    num_bytes_experts: int = 0
    num_expert_elements: int = 0
    packed_experts: bool = False  # not packed, but the routed experts are (PACKED_EXPERT_FAMILIES)

    def bytes_per_expert_weight(self) -> float:
        """Bytes an expert's weight takes as held (0.0 for a dense model)."""
        return self.num_bytes_experts / self.num_expert_elements if self.num_expert_elements else 0.0


def _block(type_name: str) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


def packed_bytes(t: GgufTensor, int8_copy: bool) -> int:
    """Bytes kvpilot's packed layers hold for tensor `t` (its blocks, or their tiled int8 copy)."""
    block_values, type_size = _block(t.type_name)
    extra = PACKED_TYPES[t.type_name] if int8_copy and t.num_rows % TILE_ROWS == 0 else 0
    return t.num_elements // block_values * (type_size + extra)


def packed_bits(type_name: str, int8_copy: bool) -> float:
    """Bits a weight of a packed GGUF type takes in kvpilot's memory."""
    block_values, type_size = _block(type_name)
    return 8 * (type_size + (PACKED_TYPES[type_name] if int8_copy else 0)) / block_values


def is_linear(t: GgufTensor, tied: bool) -> bool:
    """A weight the packed kernels multiply: decoder matrices, routed experts, the output head (the embedding when
    tied)."""
    return bool(_LINEAR.match(t.name)) or is_expert(t) or t.name == OUTPUT or (tied and t.name == EMBEDDING)


def is_expert(t: GgufTensor) -> bool:
    """Routed experts' matrices: a layer's stacked ones, or one expert's."""
    return bool(_EXPERTS.match(t.name))


def packing_problem(tensors: tuple[GgufTensor, ...], model_type: str, tied: bool, on_gpu: bool) -> str | None:
    """Why kvpilot dequantizes this file at load, or None when it keeps the linear weights packed."""
    if on_gpu:
        return "kvpilot runs GGUF weights packed on CPUs only: on a GPU it dequantizes them at load"
    if model_type not in PACKED_FAMILIES:
        return f"kvpilot's packed GGUF kernels do not run {model_type} models: it dequantizes them at load"
    unsupported = sorted({t.type_name for t in tensors if is_linear(t, tied) and t.type_name not in PACKED_TYPES})
    if unsupported:
        example = next(t.name for t in tensors if t.type_name == unsupported[0] and is_linear(t, tied))
        return (f"{', '.join(unsupported)} (e.g. {example}) has no packed kernel in kvpilot, so it dequantizes the "
                f"whole model at load (packed: {', '.join(PACKED_TYPES)})")
    return None


def int8_path_takes_all(tensors: tuple[GgufTensor, ...], model_type: str, tied: bool, cpu_int8: str) -> bool:
    """Whether a CPU whose int8 path is `cpu_int8` (INT8_COPY_TYPES) runs every linear weight of this file packed on
    an int8 copy in bf16. kvpilot's --dtype auto is then bf16 on a CPU without native bf16
    too (model/dtypes.resolve_dtype)."""
    if packing_problem(tensors, model_type, tied, on_gpu=False) is not None:
        return False
    types = {t.type_name for t in tensors if is_linear(t, tied)}
    return bool(types) and types <= INT8_COPY_TYPES[cpu_int8]


def _copies_note(compute_bits: int, copied: frozenset[str]) -> str:
    """Every packed type has an int8 copy on a CPU with an int8 path (INT8_COPY_TYPES), none on one without."""
    if compute_bits != 16:
        return ""
    if copied:
        return " with the int8 copies"
    return " as the file's blocks: no int8 copies on this CPU (they need AVX-512 VNNI or AVX2)"


def _packs_experts(experts: list[GgufTensor], model_type: str, on_gpu: bool) -> bool:
    return (model_type in PACKED_EXPERT_FAMILIES and not on_gpu and bool(experts)
            and all(t.type_name in PACKED_TYPES for t in experts))


def held_gguf(tensors: tuple[GgufTensor, ...], model_type: str, tied: bool, compute_bits: int,
              on_gpu: bool, cpu_int8: str = "vnni") -> HeldGguf:
    """What kvpilot holds for `tensors` with activations of `compute_bits` (16: bf16, with the int8 copies of the
    types the CPU's int8 path takes: `cpu_int8`, a key of INT8_COPY_TYPES)."""
    dense = {t.name: t.num_elements * compute_bits // 8 for t in tensors}
    problem = packing_problem(tensors, model_type, tied, on_gpu)
    embedding = dense.get(EMBEDDING, 0)
    experts = [t for t in tensors if is_expert(t)]
    expert_elements = sum(t.num_elements for t in experts)
    if problem is not None and _packs_experts(experts, model_type, on_gpu):
        held = {t.name: packed_bytes(t, False) if is_expert(t) else dense[t.name] for t in tensors}
        bits = ", ".join(f"{name} {packed_bits(name, False):.4g}" for name in sorted({t.type_name for t in experts}))
        head = dense.get(OUTPUT, 0)
        return HeldGguf(embedding, head, sum(held.values()) - embedding - head, False,
                        f"kvpilot holds the routed experts packed ({bits} bits a weight, the file's blocks) and "
                        f"dequantizes the other weights to {compute_bits}-bit",
                        sum(held[t.name] for t in experts), expert_elements, packed_experts=True)
    if problem is not None:
        return HeldGguf(embedding, dense.get(OUTPUT, 0), sum(dense.values()) - embedding - dense.get(OUTPUT, 0),
                        False, f"{problem}, {compute_bits} bits a weight",
                        sum(dense[t.name] for t in experts), expert_elements)
    copied = INT8_COPY_TYPES[cpu_int8] if compute_bits == 16 else frozenset()
    held = {t.name: packed_bytes(t, t.type_name in copied) if is_linear(t, tied) else dense[t.name]
            for t in tensors}
    head = held.get(OUTPUT, held.get(EMBEDDING, 0) if tied else 0)
    layers = sum(b for name, b in held.items() if name not in (EMBEDDING, OUTPUT))
    types = sorted({t.type_name for t in tensors if is_linear(t, tied)})
    bits = ", ".join(f"{name} {packed_bits(name, name in copied):.4g}" for name in types)
    copies = _copies_note(compute_bits, copied)
    what = "linear weights and experts" if experts else "linear weights"
    return HeldGguf(embedding, head, layers, True,
                    f"kvpilot holds the {what} packed ({bits} bits a weight{copies}) and the embedding table "
                    f"dense in {compute_bits}-bit for token lookups", sum(held[t.name] for t in experts),
                    expert_elements)
