"""PackedLinear: nn.Linear's forward on packed quantized weights (x @ W^T + b), for CPU.

Two paths, picked per call by the number of rows (tokens) in x:
- up to `max_kernel_rows`: the fused C++ kernel reads each packed block once and multiplies in float32
  (decode of few streams: memory-bound, so 4-bit weights read ~5x fewer bytes than bf16);
- more rows: the weights are dequantized into a scratch matrix shared by every layer (one layer at a time
  runs) in the activation dtype, then torch's GEMM runs (prefill and big batches: compute-bound, and
  MKL's GEMM is faster than the kernel's dot-product tiles there; the dequantization is a few % of it).
  With `keep_dense` (the hybrid layout) the dequantized matrix is built once, on the first many-row call, and
  kept: native bf16 GEMMs on resident weights beat both the kernel and dequantize-per-call from a few rows up.
  bf16 rows may run this GEMM in float32 instead (`bf16_gemm_dtype`, on a float32 matrix: CPUs where float32
  GEMMs beat bf16 ones, layers/prompt_gemm.py), converted at its edges.
On CPUs with AVX-512 VNNI or AVX2 the hybrid layout's bf16 activations take a third path, int8 activations times
the packed blocks (`int8_activations`): layers of whole tiles through a column-tiled copy at every row count of a
step without prompt tokens (Int8Gate), beating the resident bf16 GEMM everywhere; with VNNI, other layers (the
interleaved copy) up to INT8_MAX_ROWS rows. AVX2 emulates VNNI's dot products with vpmaddubsw
(csrc/quant_tiled_avx2.h, quant_tiled_kq_avx2.h).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.model.layers.onednn_linear import OneDnnWeight, onednn_bf16_applies
from kvpilot.model.quant.packed import PackedWeight
from kvpilot.model.quant.tiled_set import TiledSet, int8_copy
from kvpilot.model.quant.vnni_gemm import TiledWeight, dequantize_tiled
from kvpilot.model.quant.vnni_layout import InterleavedWeight, dequantize_interleaved

# Rows at and below which the fused kernel runs (benchmarks/quant_linear.py, AVX-512 EPYC, 1 thread): in
# float32 it beat dequantize + MKL GEMM at every size measured (1-512 rows: MKL's float32 GEMM on a [N, K]
# weight is slow); in bfloat16, native bf16 GEMMs overtake it between 16 and 64 rows.
DEFAULT_MAX_KERNEL_ROWS = {torch.float32: 1 << 30, torch.bfloat16: 32}
# With resident dense weights (keep_dense) the bf16 GEMM needs no dequantization, so it wins from fewer rows than
# the float32 kernel; the int8 path (INT8_MAX_ROWS, on VNNI CPUs) moves the crossover up: whole decode steps of the
# embedded model (benchmarks/decode_step.py) favoured the int8 kernel up to 32 rows, dense from 48, and the float32
# kernel lost from 24 (docs/benchmark-log.md, "Figures moved out of the code").
HYBRID_MAX_KERNEL_ROWS = {torch.float32: 1 << 30, torch.bfloat16: 16}
HYBRID_INT8_MAX_KERNEL_ROWS = {torch.float32: 1 << 30, torch.bfloat16: 32}
# The int8-activation (VNNI) path up to this many rows: all the rows the hybrid layout gives the kernel, faster
# than the float32 kernel at every one of them (benchmarks/quant_linear.py --part vnni; docs/benchmark-log.md,
# "Figures moved out of the code").
INT8_MAX_ROWS = HYBRID_INT8_MAX_KERNEL_ROWS[torch.bfloat16]
# Q4_0 / Q4_1 layers of 16-row tiles take the int8 path through the column-tiled copy (vnni_gemm.py) at every row
# count: it beats resident dense bf16 GEMMs from 1 row to prefill sizes (benchmarks/quant_linear.py --part vnni)
# -- in steps without prompt tokens (Int8Gate): int8 activations on a prompt moved the embedded model's first-token
# logits by ~0.12 (its README answer flipped), so prompt steps keep the dense bf16 GEMM. Q8_0 output layers are
# tiled too, ungated (model_pack.py): the fastest of tiled, interleaved and dense bf16 at every row count, with
# float32 logits (the figures: docs/benchmark-log.md, "Figures moved out of the code").
TILED_MAX_ROWS = 1 << 30
KERNEL_IO_DTYPES = (torch.float32, torch.bfloat16)
# the column-tiled int8 copies: one split-format part, or any parts (formats kept as GGUF blocks, mixed formats)
TILED_COPIES = (TiledWeight, TiledSet)


@dataclass
class Int8Gate:
    """Whether the tiled int8 path may take this step's rows, shared by a model's PackedLinear layers: the model
    opens it for steps without prompt tokens (decodes) and closes it for steps with them, whose rows then take
    the dense bf16 GEMM. Rounding a prompt's activations to int8 moves its logits by up to ~0.1 on the embedded
    model (enough to change its README answer), while decode rows stay within what its tests accept.
    `prompts` (--prompt-gemm-dtype int8) keeps it open for every step, as llama.cpp computes prompts: on CPUs
    whose float32 / emulated bf16 GEMMs are slower than the int8 tiles (AVX2), and no dense copy to hold."""

    open: bool = True
    prompts: bool = False

    def for_step(self, has_prompt_tokens: bool) -> None:
        self.open = self.prompts or not has_prompt_tokens


@dataclass
class DenseScratch:
    """One reusable buffer for dequantized weights, shared by all PackedLinear layers of a model."""

    buffers: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def matrix(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, cols] contiguous view; its contents are overwritten by the next caller."""
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < rows * cols:
            buf = torch.empty(rows * cols, dtype=dtype)
            self.buffers[dtype] = buf
        return buf[: rows * cols].view(rows, cols)


class PackedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W = the row-wise concatenation of `parts` (fused projections).

    Invariant: same-format parts are concatenated into one packed matrix (one kernel call); parts of
    different formats are kept apart and write side by side into one output. `dense_weight`, when given,
    returns the same values densely (a tied embedding table) for the many-row path, with no scratch.
    `keep_dense`: the many-row path's dequantized matrix is kept per dtype after its first use (more memory:
    the dense bytes besides the packed ones) instead of rebuilt in the shared scratch at every call.
    `bf16_gemm_dtype`: the many-row path's dtype for bf16 rows (float32: rows widened, the float32 dequantized
    values, one rounding of the result to bf16; float32 logits unrounded).
    `int8_activations`: up to `int8_max_rows` rows are quantized to int8 blocks and multiplied with the packed
    weights by VNNI dot products (llama.cpp's scheme; within ~1/254 of a block's largest value of the float32
    path), on a CPU with VNNI (AVX2: lone Q8_0 / Q4_0 / Q4_1 parts of whole tiles only): parts of 16-row tiles (any packed format, several side by side: tiled_set.py) use
    the column-tiled copies up to TILED_MAX_ROWS rows, a lone Q8_0 / Q4_0 / Q4_1 part of other widths the
    interleaved one up to INT8_MAX_ROWS; other layers and more rows keep the float32 kernel.
    """

    def __init__(self, parts: list[PackedWeight], bias: bool, scratch: DenseScratch, isa: int,
                 max_kernel_rows: dict[torch.dtype, int] | None = None,
                 dense_weight: Callable[[], torch.Tensor] | None = None, keep_dense: bool = False,
                 int8_activations: bool = False, int8_gate: Int8Gate | None = None,
                 bf16_gemm_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if len({p.format for p in parts}) == 1 and len(parts) > 1:
            parts = [PackedWeight.concat(parts)]
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.offsets = [sum(p.out_features for p in parts[:i]) for i in range(len(parts))]
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None
        self.scratch = scratch
        self.isa = isa
        # the int8 path's own copy of the blocks, beside the parts the float32 kernel and the dense copy read:
        # column-tiled (vnni_gemm.py, tiled_set.py) where it applies, else interleaved (vnni_layout.py)
        self.int8_weight: TiledWeight | TiledSet | InterleavedWeight | None = \
            int8_copy(parts) if int8_activations else None
        self.int8_activations = self.int8_weight is not None
        self.int8_max_rows = 0
        if self.int8_activations:
            self.int8_max_rows = TILED_MAX_ROWS if isinstance(self.int8_weight, TILED_COPIES) else INT8_MAX_ROWS
        if keep_dense:
            default_rows = {**HYBRID_INT8_MAX_KERNEL_ROWS, torch.bfloat16: self.int8_max_rows} \
                if self.int8_activations else HYBRID_MAX_KERNEL_ROWS
        else:  # packed only: bf16 rows the int8 path takes go there, more through the scratch matrix
            default_rows = {**DEFAULT_MAX_KERNEL_ROWS, torch.bfloat16: self.int8_max_rows} \
                if self.int8_activations else DEFAULT_MAX_KERNEL_ROWS
        self.max_kernel_rows = dict(max_kernel_rows or default_rows)
        self.dense_weight = dense_weight
        self.keep_dense = keep_dense
        self.int8_gate = int8_gate
        # bf16 rows' many-row GEMM runs in this dtype (float32: on a float32 copy, layers/prompt_gemm.py); a dense
        # lookup table (dense_weight) is used as it is
        self.bf16_gemm_dtype = bf16_gemm_dtype if dense_weight is None else torch.bfloat16
        self._resident: dict[torch.dtype, torch.Tensor] = {}
        # the resident bf16 copy in oneDNN's layout, where bf16 GEMMs take one (instead of _resident[bf16])
        self._onednn: OneDnnWeight | None = None

    @property
    def nbytes(self) -> int:
        """Packed bytes (with the int8 path's copy) plus any resident dense copies."""
        int8 = self.int8_weight.nbytes_beside(self.parts[0]) if self.int8_weight is not None else 0
        onednn = self._onednn.nbytes if self._onednn is not None else 0
        return sum(p.nbytes for p in self.parts) + int8 + onednn + sum(w.numel() * w.element_size()
                                                                       for w in self._resident.values())

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized [out, in] float32 values, like nn.Linear.weight (for inspection: a new tensor
        each call; the forward never builds it)."""
        if self.quants_released:
            copy = self.int8_weight
            if isinstance(copy, TiledSet):
                return copy.dequantize()
            return dequantize_tiled(copy) if isinstance(copy, TiledWeight) else dequantize_interleaved(copy)
        return torch.cat([p.dequantize(torch.float32, self.isa) for p in self.parts])

    @property
    def quants_released(self) -> bool:
        return self.parts[0].qs.numel() == 0

    def release_quants(self) -> None:
        """With the int8 path and bf16 activations: drop the packed quants only the float32 kernel reads. The
        int8 copy serves every call of up to int8_max_rows rows (a tiled copy: every call while the Int8Gate is
        open); every other call the dense copy (hybrid layout: built now), for a tied head the embedding table,
        or (packed only, a tiled copy) the scratch matrix, filled from the tiled copy per call. So the int8 path
        costs no memory beside them. The parts' scales go too (the copy holds its own, or shares them), their
        shape kept. Packed-only layers with an interleaved copy keep their quants: their many-row calls dequantize
        those."""
        if self.int8_weight is None or self.quants_released:
            return
        if not self.keep_dense and not isinstance(self.int8_weight, TILED_COPIES):
            return
        if self.keep_dense and self.dense_weight is None:
            self._dense(self.bf16_gemm_dtype)
        self.parts = [replace(p, qs=p.qs.new_empty(0), d=p.d.new_empty(0), m=None,
                              shape=(p.out_features, p.in_features)) for p in self.parts]
        for dtype in self.max_kernel_rows:  # every dtype's few rows through the int8 path, more through dense
            self.max_kernel_rows[dtype] = min(self.max_kernel_rows[dtype], self.int8_max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, x.dtype)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """forward with float32 results (an output head's logits): the kernel paths accumulate in float32 and
        keep it, where rounding logits to bf16 (steps of 1/8 at 16) turns near ties into exact ties that the
        argmax then breaks by token id; the dense path rounds to x's dtype as before."""
        return self._forward(x, torch.float32)

    def _forward(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self._kernel_takes(rows):
            out = self._kernel_rows(rows, out_dtype if out_dtype in KERNEL_IO_DTYPES else torch.float32)
        elif self._onednn is not None and x.dtype == torch.bfloat16:
            out = self._onednn.linear(rows)
        else:
            dtype = self.bf16_gemm_dtype if x.dtype == torch.bfloat16 else x.dtype
            out = F.linear(rows.to(dtype), self._dense(dtype))
        if out.dtype != out_dtype:
            out = out.to(out_dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def greedy_ids(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of forward_float32(x) (the first of equal maxima) without building the [rows, out]
        logits, where the rows take the tiled int8 path (a Q8_0 / Q4 output head on a VNNI CPU): the same float32
        values, folded while in cache. None where they would take another path, or where a value is NaN (the
        caller builds the logits then)."""
        rows = x.reshape(-1, self.in_features)
        if not self._tiled_rows(rows) or self.bias is not None:
            return None
        ids = self.int8_weight.argmax(rows.contiguous())
        return None if bool((ids < 0).any()) else ids

    def _kernel_takes(self, rows: torch.Tensor) -> bool:
        """Whether _forward gives these rows to the kernel paths (_kernel_rows) rather than a dense GEMM."""
        return rows.shape[0] <= self.max_kernel_rows.get(rows.dtype, 0) and not self._gated()

    def _tiled_rows(self, rows: torch.Tensor) -> bool:
        """Whether _forward sends these rows through the tiled int8 copy (as they are: float32 or bf16)."""
        return (rows.dtype in KERNEL_IO_DTYPES and self._kernel_takes(rows)
                and isinstance(self.int8_weight, TILED_COPIES) and rows.shape[0] <= self.int8_max_rows)

    def _gated(self) -> bool:
        """A step with prompt tokens on a tiled layer: the dense path, not the int8 one (Int8Gate)."""
        return self.int8_gate is not None and not self.int8_gate.open and isinstance(self.int8_weight, TILED_COPIES)

    def _kernel_rows(self, rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """float32 or bfloat16 rows go to the kernel as they are (it converts, computing in float32), other
        dtypes through float32; the result comes back as out_dtype (float32 or bfloat16)."""
        x = (rows if rows.dtype in KERNEL_IO_DTYPES else rows.to(torch.float32)).contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        if self.int8_weight is not None and x.shape[0] <= self.int8_max_rows:
            self.int8_weight.matmul_into(out, x)
            return out
        for part, offset in zip(self.parts, self.offsets):
            part.matmul_into(out[:, offset:offset + part.out_features], x, self.isa)
        return out

    def _dense(self, dtype: torch.dtype) -> torch.Tensor:
        if self.dense_weight is not None:
            return self.dense_weight().to(dtype)
        if self.quants_released and self.keep_dense and dtype not in self._resident:  # convert the kept copy
            return self._kept_copy().to(dtype)
        if dtype not in (torch.float32, torch.bfloat16):
            return self._dense(torch.float32).to(dtype)
        if dtype == torch.bfloat16 and self._onednn is not None:
            return self._onednn.dense()
        resident = self._resident.get(dtype)
        if resident is not None:
            return resident
        weight = self.scratch.matrix(self.out_features, self.in_features, dtype)
        if self.quants_released and not self.keep_dense:  # packed only: the tiled copy holds the blocks
            self.int8_weight.dequantize_into(weight)
            return weight
        for part, offset in zip(self.parts, self.offsets):
            part.dequantize_into(weight[offset:offset + part.out_features], self.isa)
        if self.keep_dense and onednn_bf16_applies(dtype, weight.device):
            self._onednn = OneDnnWeight(weight)  # the scratch matrix returned stays valid for this call
        elif self.keep_dense:  # kept in the dense model's layout (weight_layout.py: [in, out] memory, but bf16 as is)
            weight = self._resident[dtype] = weight.clone() if dtype == torch.bfloat16 else weight.t().contiguous().t()
        return weight

    def _kept_copy(self) -> torch.Tensor:
        """The one dense copy a layer without its packed quants keeps (bf16 in oneDNN's layout, or plain)."""
        return self._onednn.dense() if self._onednn is not None else next(iter(self._resident.values()))

    def extra_repr(self) -> str:
        formats = "+".join(p.format.name for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, format={formats}"
