"""Quantize-at-load (`--quantization int8|int4`): a model's dense linear weights (HF, dummy, or a GGUF
dequantized first) become packed blocks run by the same CPU kernels as GGUF weights.

int8 is Q8_0 (int8 values, one float16 scale per 32 weights: symmetric); int4 is Q4_1 (4-bit values, a
float16 scale and minimum per 32 weights: asymmetric, which keeps more of the range than Q4_0's symmetric
grid). The output layer stays int8 under int4 (as llama.cpp's 4-bit files keep it at 6-8 bits): in 4 bits it
alone cost the embedded model 7% perplexity. Weight-only: activations stay in --dtype. Blocks are quantized by the gguf package (the reference
GGUF quantizer), so a quantized layer holds exactly what a GGUF file of that type would.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvpilot.model.errors import ModelLoadError
from kvpilot.model.quant.formats import BLOCK_VALUES, FORMATS, QuantFormat
from kvpilot.model.quant.kernel import best_isa
from kvpilot.model.quant.linear import DenseScratch, PackedLinear
from kvpilot.model.quant.model_pack import install_int8_gate, release_packed_quants
from kvpilot.model.quant.packed import PackedWeight

AT_LOAD_FORMATS = {"int8": FORMATS["Q8_0"], "int4": FORMATS["Q4_1"]}


def quantize_weight(weight: torch.Tensor, fmt: QuantFormat) -> PackedWeight:
    """A [N, K] float weight as packed blocks of `fmt` (K a multiple of 32)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if weight.shape[-1] % BLOCK_VALUES:
        raise ModelLoadError(f"cannot quantize a weight with {weight.shape[-1]} input features to {fmt.name}: "
                             f"blocks hold {BLOCK_VALUES} values; use --quantization none")
    values = np.ascontiguousarray(weight.detach().to(torch.float32).numpy())
    return PackedWeight.from_blocks(quantize(values, GGMLQuantizationType[fmt.name]), fmt)


@torch.no_grad()
def quantize_linear_layers(model: nn.Module, quantization: str, compute_dtype: torch.dtype = torch.float32,
                           gemm_dtype: torch.dtype | None = None) -> None:
    """Replaces the model's projections and output layer by PackedLinear modules holding their weights
    quantized to `quantization` (int8 or int4). Biases, norms and the embedding table stay dense. With bf16
    `compute_dtype` on a VNNI CPU, decode steps take the int8 path (the tiled copy, then the layers' only copy
    of their blocks) and steps with prompt tokens dense GEMMs on those values (model_pack.install_int8_gate), in
    `gemm_dtype` (layers/prompt_gemm.py; default compute_dtype)."""
    if quantization not in AT_LOAD_FORMATS:
        raise ModelLoadError(f"quantization {quantization!r} is not one of {', '.join(AT_LOAD_FORMATS)}")
    if best_isa() < 0:
        raise ModelLoadError(f"--quantization {quantization} needs the CPU quantized-linear kernel, which could "
                             "not be built (see the warning above); use --quantization none")
    fmt, scratch, isa = AT_LOAD_FORMATS[quantization], DenseScratch(), best_isa()
    gate = install_int8_gate(model, compute_dtype)

    def packed(weight: torch.Tensor, bias: torch.Tensor | None = None, fmt: QuantFormat = fmt,
               gated: bool = True) -> PackedLinear:
        module = PackedLinear([quantize_weight(weight, fmt)], bias is not None, scratch, isa,
                              int8_activations=gate is not None, int8_gate=gate if gated else None,
                              bf16_gemm_dtype=gemm_dtype or torch.bfloat16)
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return module

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = packed(attn.qkv_proj.weight, attn.qkv_proj.bias)
        attn.o_proj = packed(attn.o_proj.weight)
        mlp.gate_up_proj = packed(mlp.gate_up_proj.weight)
        mlp.down_proj = packed(mlp.down_proj.weight)
    output_fmt = FORMATS["Q8_0"]
    if model.lm_head is None:  # tied: the lookup table stays exact, the output layer is quantized
        model.output_head = packed(model.embed_tokens.weight, fmt=output_fmt, gated=False)
    else:
        model.lm_head = packed(model.lm_head.weight, fmt=output_fmt, gated=False)
        model.output_head = model.lm_head
    release_packed_quants(model, compute_dtype)
