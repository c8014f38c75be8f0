"""Which of a GGUF model's linear layers stay packed, and swapping them into the model.

`--quantization` (EngineArgs.quantization), for GGUF files:
- auto (default): packed on CPU when every linear weight (routed experts included: packed_experts.py, never with a
  dense copy) is Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K / IQ4_NL / IQ4_XS / MXFP4
  (formats.PACKED_FORMATS: llama.cpp's Q4_K_M and Q5_K_M mixes included) and the kernel builds; otherwise
  dequantized at load (other IQ-quants, float GGUFs, GPUs). With bfloat16 activations the layout is
  hybrid: the packed kernel for few rows (decode of few streams reads 4-bit weights) and resident dense
  weights for more rows (native bf16 GEMMs beat the kernel from about 16 rows up; docs/benchmark-log.md has the
  figures), at the price of holding both copies (the dense one in float32 where float32 GEMMs measure faster
  than bf16 ones at load, layers/prompt_gemm.py: twice the bytes). Float32 activations stay packed only
  (packed beats dense float32 at every batch);
- gguf: packed only, or a ModelLoadError naming the tensor types the kernels lack. With bf16 activations on a
  CPU with the int8 path (VNNI, or AVX2 for Q8_0 / Q4_0 / Q4_1) the int8 path's tiled copy is then the only copy of the blocks: decode steps run on it, steps with
  prompt tokens dequantize it per layer into one shared scratch matrix instead of keeping a dense copy (less
  resident memory than auto, at a per-step cost);
- none: dequantized to --dtype at load (dense matmuls);
- int8 / int4: any model's dense weights quantized at load (quant/at_load.py; a GGUF is dequantized first);
- fp8: the decoder layers' weights as float8 e4m3 with per-channel scales, activations per token (quant/fp8.py:
  for Hopper and Ada GPUs; CPU torch runs it slowly);
- awq / gptq / fp8 / compressed-tensors on an HF directory whose config.json declares that quantization: its
  pre-quantized weights as they are (quant/checkpoint_load.py); auto reads them the same way.
--dtype still sets the activations' dtype either way.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.layers.onednn_linear import copy_fits
from kvpilot.model.quant.formats import SUPPORTED_NAMES, packed_format
from kvpilot.model.quant.kernel import best_isa, has_int8_tiles
from kvpilot.model.quant.linear import DenseScratch, Int8Gate, PackedLinear
from kvpilot.model.quant.packed import PackedWeight
from kvpilot.model.quant.packed_experts import ExpertBlocks, PackedExperts, expert_blocks_of_layer

logger = logging.getLogger("kvpilot")

# awq, gptq, compressed-tensors: pre-quantized HF checkpoints only (quant/checkpoint_scheme.py; fp8 reads those too)
QUANTIZATIONS = ("auto", "gguf", "none", "int8", "int4", "fp8", "awq", "gptq", "compressed-tensors")
EMBED = "model.embed_tokens.weight"


def check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")


def packed_names(quantization: str, device: torch.device, tensor_types: dict[str, str], config: ModelConfig,
                 path: Path) -> frozenset[str]:
    """The HF names of the linear weights to keep packed (empty: dequantize the whole model).

    `tensor_types` maps every linear weight of the file to its GGUF type name. Raises ModelLoadError
    when quantization="gguf" cannot be honoured, naming what is unsupported and what is supported.
    """
    check_quantization(quantization)
    if quantization in ("none", "int8", "int4", "fp8"):
        return frozenset()
    wanted = {name for name in tensor_types if name != EMBED or config.tie_word_embeddings}
    if config.tie_word_embeddings:
        wanted.discard("lm_head.weight")
    problem = _packing_problem(device, {name: tensor_types[name] for name in wanted}, path)
    if problem is None:
        return frozenset(wanted)
    if quantization == "gguf":
        raise ModelLoadError(problem + "; pass --quantization none to dequantize the weights at load instead")
    logger.info("%s: dequantizing the weights at load", problem)
    return frozenset()


def _packing_problem(device: torch.device, types: dict[str, str], path: Path) -> str | None:
    if device.type != "cpu":
        return f"{path}: packed quantized weights run on CPU only (device {device.type})"
    unsupported = sorted({t for t in types.values() if packed_format(t) is None})
    if unsupported:
        example = next(name for name, t in types.items() if t == unsupported[0])
        return (f"{path}: linear weights of type {', '.join(unsupported)} (e.g. {example}) have no packed "
                f"kernel; the packed kernels support {SUPPORTED_NAMES}")
    if best_isa() < 0:
        return f"{path}: the CPU quantized-linear kernel could not be built (see the warning above)"
    mixed = _mixed_expert_formats(types)
    if mixed is not None:
        return f"{path}: the experts of {mixed} are of different types; packed experts take one type a layer"
    return None


_ONE_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.(\w+)_proj\.weight$")


def _mixed_expert_formats(types: dict[str, str]) -> str | None:
    """Older Mixtral files keep one tensor per expert: 'layer N's KIND' where those differ in type, else None."""
    seen: dict[tuple[str, str], str] = {}
    for name, type_name in types.items():
        match = _ONE_EXPERT.match(name)
        if match is not None and seen.setdefault(match.groups(), type_name) != type_name:
            return f"layer {match.group(1)}'s {match.group(2)}"
    return None


def keeps_dense(quantization: str, compute_dtype: torch.dtype, packed: dict[str, PackedWeight],
                available_bytes: int, gemm_dtype: torch.dtype | None = None) -> bool:
    """The hybrid layout (see the module docstring): auto, non-float32 activations, and a dense copy of the
    packed weights in `gemm_dtype` (the many-row GEMMs' dtype; default compute_dtype) that fits in
    `available_bytes` (onednn_linear.copy_fits)."""
    if quantization != "auto" or compute_dtype == torch.float32 or not packed:
        return False
    gemm_dtype = gemm_dtype or compute_dtype
    # a tied output head's many-row path reads the embedding table itself: it builds no copy; experts keep none
    dense_bytes = sum(w.out_features * w.in_features for name, w in packed.items()
                      if name != EMBED and isinstance(w, PackedWeight)) * gemm_dtype.itemsize
    dtype = str(gemm_dtype).removeprefix("torch.")
    return copy_fits(dense_bytes, available_bytes, f"packed weights only: their dense {dtype} copy for many-row GEMMs")


def install_int8_gate(model: nn.Module, compute_dtype: torch.dtype) -> Int8Gate | None:
    """The model's Int8Gate (the model opens it for decode steps, llama.py) when packed layers take the
    int8-activation path: bf16 activations (int8 blocks round about as coarsely, 2^-8) on a CPU with AVX-512
    VNNI, or AVX2 (its layers of whole tiles only: tiled_set.int8_copy); else None. Sets model.int8_gate either
    way."""
    model.int8_gate = Int8Gate() if compute_dtype == torch.bfloat16 and has_int8_tiles() else None
    return model.int8_gate


def pack_linear_layers(model: nn.Module, packed: dict[str, PackedWeight | ExpertBlocks], config: ModelConfig,
                       keep_dense: bool = False, compute_dtype: torch.dtype = torch.float32,
                       gemm_dtype: torch.dtype | None = None) -> None:
    """Replaces the model's projections (and output layer) with PackedLinear modules over `packed`, and the
    routed experts of mixture-of-experts layers with PackedExperts (int8 tiled copies where the int8 path applies,
    else the blocks; never a dense copy);
    `keep_dense`: each also keeps the dense copy its many-row path builds (the hybrid layout), in `gemm_dtype`
    for bf16 activations (layers/prompt_gemm.py; default compute_dtype). With bf16 `compute_dtype` on a CPU
    with the int8 path (install_int8_gate), decode steps take it, hybrid or packed only.

    Call on the model before its parameters are materialized (the dense weights are never allocated);
    the remaining parameters (norms, embeddings, biases) load as usual afterwards.
    """
    scratch = DenseScratch()
    isa = best_isa()
    gate = install_int8_gate(model, compute_dtype)

    def make(names: list[str], bias: bool = False, dense: Callable[[], torch.Tensor] | None = None,
             gated: bool = True) -> PackedLinear:
        return PackedLinear([packed[name] for name in names], bias, scratch, isa, dense_weight=dense,
                            keep_dense=keep_dense, int8_activations=gate is not None,
                            int8_gate=gate if gated else None, bf16_gemm_dtype=gemm_dtype or torch.bfloat16)

    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = make([f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"], bias=config.attention_bias)
        attn.o_proj = make([f"{prefix}self_attn.o_proj.weight"])
        experts = expert_blocks_of_layer(packed, i)
        if experts is not None:  # a SparseMoeBlock's experts (its router stays dense: GGUF keeps it F32)
            mlp.experts = PackedExperts(*experts, isa=isa, int8=gate is not None)
            continue
        mlp.gate_up_proj = make([f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"])
        mlp.down_proj = make([f"{prefix}mlp.down_proj.weight"])
    # The output layer is not gated: its int8 rows are the sampled positions' final hidden states, each rounded
    # once (not carried through 30 layers as a prompt's are), and its float32 logits keep near ties apart.
    if config.tie_word_embeddings:  # many rows (prefill logits) use the dense lookup table, same values
        model.output_head = make([EMBED], dense=lambda: model.embed_tokens.weight, gated=False)
    else:
        model.lm_head = make(["lm_head.weight"], gated=False)
        model.output_head = model.lm_head


def pack_experts(model: nn.Module, packed: dict[str, ExpertBlocks]) -> None:
    """Replaces the routed experts of every mixture-of-experts layer with PackedExperts over `packed` (their blocks,
    run by the float32 kernel), keeping each Experts' biases and activation; every other layer stays dense. For a
    family whose dense layers the packed kernels do not run (gpt-oss: registry `packed_gguf_experts`). Call before
    the parameters are materialized, as pack_linear_layers."""
    model.int8_gate = None
    for i, layer in enumerate(model.layers):
        experts = expert_blocks_of_layer(packed, i)
        if experts is not None:
            dense = layer.mlp.experts
            layer.mlp.experts = PackedExperts(*experts, isa=best_isa(), int8=False,
                                              bias=dense.gate_up_proj_bias is not None, activation=dense.activation)


def release_packed_quants(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """With bf16 activations, the int8 path needs neither the packed quants (its copy holds them) nor the float32
    kernel: each PackedLinear drops them (PackedLinear.release_quants; the hybrid layout builds its dense copy
    first), ~the packed bytes less resident memory."""
    if compute_dtype != torch.bfloat16:
        return
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.release_quants()
