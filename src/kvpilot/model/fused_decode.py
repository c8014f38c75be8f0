"""FusedDecode: all decoder layers of a small decode-only step in one C++ call (CPU, bf16 or float32, packed
weights).

A decode step of few sequences is memory-bound in the packed matmuls, and everything between them is dispatch:
at batch 1 the embedded model spent ~4 of its ~10 ms per step in Python and torch calls (about 15 ops and 8
module calls per layer). The kernel (layers/csrc/decode_layers_cpu.cpp) runs the same functions back to back:
the packed matmuls (int8-activation or float32 path, as PackedLinear picks), RMSNorm, RoPE and SiLU-and-mul (the
bf16 ops; in float32 the torch ops the modules run), the K/V write, the paged decode-attention kernel, and torch's
add, so the hidden states are bit for bit the layer-by-layer forward's. Float32 (the auto dtype of CPUs without
native bf16) gains the most: its modules run every small op as torch calls from Python.

It applies to a model whose every layer has plain causal attention (no sliding window, soft-cap or sinks),
packed projections without bias or q/k norms (a fused projection's parts may differ in format; every projection
takes the int8 path or none does), norm weights and a KV cache in the activations' dtype (bf16 or float32), and
to a step whose tokens are all decodes, in one consecutive batch, no more than the packed kernels' row limit, run
by the cpu attention backend. A dense bf16 model whose every projection is a Bf16Linear (AVX512_BF16, no bias)
qualifies too, up to the rows its kernel takes (bf16_linear.KERNEL_MAX_ROWS; where every one also keeps a copy
for many rows, on AMX CPUs, steps from TILES_MIN_ROWS (tile-packed copies) or ONEDNN_MIN_ROWS (oneDNN-prepacked
ones) rows run the copies, up to DENSE_FUSED_MAX_ROWS),
and so does one whose every projection is a OneDnnLinear (oneDNN-prepacked): its projections run the op
OneDnnLinear runs, up to the rows from which that layer turns to its float32 copy (DENSE_FUSED_MAX_ROWS at most).
Anything else takes the modules.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from kvpilot.model.attention.base import StepAttention
from kvpilot.model.layers.cpp_build import CppKernel, build_cpp_kernel
from kvpilot.model.layers.cpu_bf16_ops import get_bf16_ops
from kvpilot.model.layers.bf16_linear import KERNEL_MAX_ROWS, ONEDNN_MIN_ROWS, TILES_MAX_ROWS, TILES_MIN_ROWS, \
    Bf16Linear
from kvpilot.model.layers.onednn_linear import OneDnnLinear
from kvpilot.model.quant.kernel import SOURCE_NAMES as QUANT_SOURCE_NAMES
from kvpilot.model.quant.linear import INT8_MAX_ROWS, TILED_COPIES, PackedLinear
from kvpilot.model.quant.tiled_set import TiledSet
from kvpilot.model.quant.vnni_gemm import TiledWeight
from kvpilot.model.quant.vnni_layout import InterleavedWeight

logger = logging.getLogger("kvpilot")

_CSRC = Path(__file__).resolve().parent / "layers" / "csrc"
# one translation unit: the kernels it calls, then the layer loop (the headers are not on an include path)
SOURCE_PATHS = tuple(_CSRC / name for name in (
    *QUANT_SOURCE_NAMES,
    "decode_common.h", "simd_exp.h", "decode_avx512.h", "decode_avx2.h", "decode_vector.h", "paged_decode_cpu.cpp",
    "bf16_ops_avx512.h", "bf16_ops_avx2.h", "bf16_gemm_avx512.h", "bf16_gemm_amx.h",
    "bf16_ops_cpu.cpp", "decode_layers_cpu.cpp"))

# The flags of the modules whose code it includes, so each function computes exactly what it computes there:
# -ffast-math as the quantized-linear and decode-attention kernels (the int8 path's scales round differently
# without it), -march=native as the decode-attention kernel (its AVX-512 path has no target attributes); the
# bf16 ops, built without -ffast-math, switch it off for their functions (a pragma in bf16_ops_cpu.cpp).
_KERNEL = CppKernel(label="CPU fused decode kernel", name_prefix="kvpilot_cpu_fused_decode_", sources=SOURCE_PATHS,
                    functions=("decode_layers",), cflags=("-O3", "-march=native", "-ffast-math"),
                    serial="fused decode steps run on one thread",
                    fallback="decode steps run layer by layer")

ATTENTION_BACKEND = "cpu"
# Rows up to which the fused path runs when the packed matmuls take the float32 kernel (no VNNI, or more rows
# than the int8 path's INT8_MAX_ROWS): benchmarks/decode_step.py --compare-fused found it faster up to 8 rows and
# slower from 9 (docs/benchmark-log.md, "Figures moved out of the code"): the float32 kernel's many-row tiles ran
# slower in this translation unit (-march=native) than in their own; up to 4 rows that kernel takes its fused
# few-row path.
FLOAT32_KERNEL_MAX_ROWS = 4
# Rows up to which it runs when every projection takes the int8 path on its tiled copy (vnni_gemm.py), which the
# layer loop also takes at every row count: the same kernels either way, less Python per step (the scheduler's
# default max_num_seqs)
TILED_FUSED_MAX_ROWS = 256
# A dense bf16 model's limit (its oneDNN GEMMs take any row count; above this a step's Python is a small share)
DENSE_FUSED_MAX_ROWS = 256
ONEDNN_BF16_CODE = 100  # decode_layers_cpu.cpp's kOneDnnBf16: a part held as a oneDNN-prepacked bf16 weight
PLAIN_BF16_CODE = 101  # its kPlainBf16: a Bf16Linear's plain weight, run by the kernel Bf16Linear runs
TILES_BF16_CODE = 102  # its kTilesBf16: a Bf16Linear's copy packed for AMX tiles, run as Bf16Linear runs it
DENSE_LINEARS = (OneDnnLinear, Bf16Linear)


@lru_cache(maxsize=1)
def get_fused_decode_kernel() -> Any | None:
    """The compiled module, or None when it cannot be built or is switched off (KVPILOT_CPU_KERNELS=0)."""
    return build_cpp_kernel(_KERNEL)


class FusedDecode:
    """Runs a model's decoder layers for a decode-only step; build with `for_model`.

    Invariant: `__call__(x, ...)` returns what `for layer in model.layers: x = layer(x, ...)` returns, bit for
    bit, whenever `applies` says yes.
    """

    def __init__(self, model: torch.nn.Module, kernel: Any, dtype: torch.dtype) -> None:
        self.kernel = kernel
        config = model.config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.eps = float(config.rms_norm_eps)
        self.dtype = dtype  # the activations', norm weights' and KV cache's (_qualifying_dtype)
        self.scale = float(config.head_dim ** -0.5)
        linears = [lin for layer in model.layers for lin in _projections(layer)]
        # from this many rows a step runs the Bf16Linears' prepacked copies (wide_weights), where all have one
        self.wide_min_rows: int | None = None
        if isinstance(linears[0], Bf16Linear):  # a dense bf16 model (_qualifying_dtype: all of them, no bias)
            self.int8_activations, self.isa = False, 0
            self.max_rows = KERNEL_MAX_ROWS  # the rows its kernel takes (more: oneDNN, in the modules)
            if all(lin.tiles is not None for lin in linears):  # as the modules run them: their tiles rows
                self.wide_min_rows, self.max_rows = TILES_MIN_ROWS, min(TILES_MAX_ROWS, DENSE_FUSED_MAX_ROWS)
            elif all(lin.onednn is not None for lin in linears):
                self.wide_min_rows, self.max_rows = ONEDNN_MIN_ROWS, DENSE_FUSED_MAX_ROWS
        elif isinstance(linears[0], OneDnnLinear):  # the same, on oneDNN-prepacked weights
            self.int8_activations, self.isa = False, 0
            self.max_rows = min([DENSE_FUSED_MAX_ROWS, *(lin.float32_min_rows - 1 for lin in linears
                                                         if lin.float32_min_rows is not None)])
        else:
            self.int8_activations = all(lin.int8_activations for lin in linears)
            tiled = all(isinstance(lin.int8_weight, TILED_COPIES) for lin in linears)
            self.max_rows = min(min(lin.max_kernel_rows.get(self.dtype, 0) for lin in linears),
                                TILED_FUSED_MAX_ROWS if tiled else
                                INT8_MAX_ROWS if self.int8_activations else FLOAT32_KERNEL_MAX_ROWS)
            self.isa = linears[0].isa
        self.weights, self.formats = _kernel_weights(model)
        self.wide_weights, self.wide_formats = (_kernel_weights(model, wide=True) if self.wide_min_rows is not None
                                                else (self.weights, self.formats))

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> FusedDecode | None:
        """The fused path for `model` (building its kernel now, not in the first request), or None when the
        model does not qualify or the kernel cannot be built."""
        dtype = _qualifying_dtype(model)
        if dtype is None or (dtype == torch.bfloat16 and get_bf16_ops() is None):
            return None
        kernel = get_fused_decode_kernel()
        return None if kernel is None else cls(model, kernel, dtype)

    def applies(self, x: torch.Tensor, kv_caches: list[torch.Tensor], attn: StepAttention) -> bool:
        meta = attn.meta
        rows = x.shape[0]
        # one block table for every layer: a model with several KV groups runs layer by layer
        if (x.dtype != self.dtype or rows > self.max_rows or attn.backend.name != ATTENTION_BACKEND
                or attn.group_metas or meta.prefills or len(meta.decodes) != 1 or kv_caches[0].dtype != self.dtype):
            return False
        return meta.decodes[0].row_range == (0, rows)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
                 attn: StepAttention) -> torch.Tensor:
        meta = attn.meta
        batch = meta.decodes[0]
        int8 = self.int8_activations
        wide = self.wide_min_rows is not None and x.shape[0] >= self.wide_min_rows
        weights, formats = (self.wide_weights, self.wide_formats) if wide else (self.weights, self.formats)
        return self.kernel.decode_layers(
            x.contiguous(), cos.contiguous(), sin.contiguous(), weights, formats, kv_caches,
            meta.slot_mapping, batch.block_tables, batch.context_lens, self.num_heads, self.num_kv_heads,
            self.eps, self.scale, int8, self.isa)


def _kernel_weights(model: torch.nn.Module, wide: bool = False) -> tuple[list[torch.Tensor], list[int]]:
    """The kernel's weights and formats: per layer, in its order, in_norm, qkv, o, post_norm, gate_up, down; a
    projection's formats are its part count then their codes, its weights 3 per part (_projection_weights)."""
    weights: list[torch.Tensor] = []
    formats: list[int] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for norm, projections in ((layer.input_layernorm, (attn.qkv_proj, attn.o_proj)),
                                  (layer.post_attention_layernorm, (mlp.gate_up_proj, mlp.down_proj))):
            weights.append(norm.weight.detach())
            for lin in projections:
                weights += _projection_weights(lin, wide)
                formats += _projection_formats(lin, wide)
    return weights, formats


def _projection_formats(lin: PackedLinear | OneDnnLinear | Bf16Linear, wide: bool = False) -> list[int]:
    """The part count, then each part's code (`wide`: a Bf16Linear's prepacked copy where it has one)."""
    if wide and isinstance(lin, Bf16Linear) and lin.tiles is not None:
        return [1, TILES_BF16_CODE]
    if isinstance(lin, OneDnnLinear) or (wide and isinstance(lin, Bf16Linear) and lin.onednn is not None):
        return [1, ONEDNN_BF16_CODE]
    if isinstance(lin, Bf16Linear):
        return [1, PLAIN_BF16_CODE]
    return [len(lin.parts), *(part.format.code for part in lin.parts)]


def _projection_weights(lin: PackedLinear | OneDnnLinear | Bf16Linear, wide: bool = False) -> list[torch.Tensor]:
    """3 tensors a part: the int8 path's copy where the layer has one (the kernel tells tiled from interleaved by
    td's rank), else the packed blocks (qs, d, m) for the float32 kernel; a dense layer's weight (OneDnnLinear's
    prepacked, Bf16Linear's plain, or with `wide` its prepacked copy where it has one) and two unused tensors."""
    if isinstance(lin, DENSE_LINEARS):
        empty = torch.empty(0)
        if wide and isinstance(lin, Bf16Linear) and lin.tiles is not None:
            return [lin.tiles.packed, empty, empty]
        prepacked = isinstance(lin, OneDnnLinear) or (wide and lin.onednn is not None)
        return [lin.onednn.packed if prepacked else lin.weight.detach(), empty, empty]
    copy = lin.int8_weight
    if isinstance(copy, TiledSet):
        return copy.tensors()
    if isinstance(copy, TiledWeight):
        return [copy.tq, copy.td, copy.to]
    if isinstance(copy, InterleavedWeight):
        return [copy.vq, copy.vd, copy.vo]
    return [t for part in lin.parts for t in (part.qs, part.d, part.min_or_empty())]


def _projections(layer: torch.nn.Module) -> list[Any]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _qualifying_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype (bfloat16 or float32) of every norm weight of a model the kernel can run, else None."""
    layers = getattr(model, "layers", None)
    if not layers:
        return None
    int8_paths = set()  # the kernel takes one int8 flag for every projection; dense layers: their class
    dtypes = set()
    for layer in layers:
        if layer.self_attn.q_norm is not None or not _plain_attention(layer.self_attn):
            return None
        for lin in _projections(layer):
            if not isinstance(lin, (PackedLinear, *DENSE_LINEARS)) or lin.bias is not None:
                return None
            int8_paths.add(type(lin).__name__ if isinstance(lin, DENSE_LINEARS) else lin.int8_activations)
        if len(int8_paths) > 1:
            return None
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.device.type != "cpu":
                return None
            dtypes.add(norm.weight.dtype)
    if len(dtypes) != 1 or not dtypes <= {torch.bfloat16, torch.float32}:
        return None
    return dtypes.pop()


def _plain_attention(attn: torch.nn.Module) -> bool:
    """The kernel's attention is plain causal at head_dim ** -0.5 (its paged_decode call): a layer with a sliding
    window, logit soft-cap or sinks (LayerAttention.features), or another scale, takes the modules."""
    layer = getattr(attn, "layer_attention", None)
    if getattr(attn, "sliding_window", None) is not None:
        return False
    if layer is None:
        return True
    return not layer.features and layer.scale == attn.head_dim ** -0.5
