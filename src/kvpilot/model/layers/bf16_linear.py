"""Bf16Linear: nn.Linear's product for a bf16 weight on a CPU with AVX512_BF16, the weight kept as nn.Linear keeps it
([out, in], the same tensor, no copy). Calls of up to KERNEL_MAX_ROWS rows (decode steps; the output layer on a
step's last rows) run the C++ kernel (csrc/bf16_gemm_avx512.h, through layers/cpu_bf16_ops.py); more rows run
oneDNN through F.linear.

Why: a decode step's GEMMs are bound by the weight bytes they read. oneDNN read them at about half the memory
bandwidth at 1-16 rows, prepacked or not, and reordered a plain weight (the tied output layer, the embedding
table) on every call; the kernel streams each weight once in its own layout (docs/benchmark-log.md has the
figures). Prompts' many rows are compute-bound, where oneDNN on the plain weight is as fast as on its prepacked
copy, so the weight is held once.

On CPUs with AMX, tile kernels outrun this one from ~8 rows: there each layer also keeps a copy packed for AMX
tiles (`tiles`, layers/amx_tiles.py, set by onednn_linear.prepack_bf16_linears where the copies fit in memory),
run for calls of TILES_MIN_ROWS to TILES_MAX_ROWS rows: bf16 products, float32 sums, as the kernel's (faster
than oneDNN's own tile kernels on a prepacked copy at every row count of a decode step). Where the kernel module
cannot use the tiles, a decoder projection keeps a oneDNN-prepacked copy (`onednn`) for ONEDNN_MIN_ROWS rows or
more instead, and the output head a float32 copy (`float32_copy`) for FLOAT32_COPY_MIN_ROWS rows or more: oneDNN
has no bf16 GEMM with float32 results, but runs a float32 GEMM on AMX tiles in bf16 when told to (its fp32 math
mode 'bf16'), reading twice the bytes.

Invariant: up to KERNEL_MAX_ROWS rows (below TILES_MIN_ROWS or ONEDNN_MIN_ROWS where a layer has a copy), each
output row is the kernel's float32 sum (+ bias) rounded once to bf16 (forward) or kept in float32
(forward_float32), the same whatever other rows share the call; so is each row of the tiles' (their sums are
added in another order than the kernel's, so they may differ from its in the last float32 bits). More rows give
oneDNN's result (F.linear's, or the prepacked copy's, which on AMX rounds by the call's row count:
onednn_linear.py; the float32 copy's sums, too, may differ from the kernel's in the last float32 bits).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.model.layers.amx_tiles import AmxTileWeight
from kvpilot.model.layers.cpu_bf16_ops import get_bf16_ops

# up to here the kernel, beyond it oneDNN (about even at 64-128 rows on the embedded model's shapes)
KERNEL_MAX_ROWS = 64
# from here a layer with a prepacked copy (AMX CPUs) runs it: even with the kernel at 6-8 rows, 1.5x at 16
# (benchmarks/bf16_gemm.py, docs/benchmark-log.md 2026-12-02 11:29)
ONEDNN_MIN_ROWS = 8
# from here an output head with a float32 copy (AMX CPUs) runs it (even with the kernel at ~24 rows in a decode
# step: the copy is twice the bytes; docs/benchmark-log.md 2026-12-02 14:02)
FLOAT32_COPY_MIN_ROWS = 32
# from here a layer packed for AMX tiles runs them: the kernel's time grows with the rows, the tiles' stays near the
# weight's bytes read once, and they read them faster than the kernel even at one row (benchmarks/bf16_gemm.py)
TILES_MIN_ROWS = 1
# up to here (prompts' many rows: oneDNN's blocking on the plain weight caught up with the tiles by 512)
TILES_MAX_ROWS = 256


def bf16_gemm_kernel(dtype: torch.dtype, device: torch.device) -> Any | None:
    """The kernel module where Bf16Linear applies: a bf16 weight on a CPU with AVX512_BF16 and the kernels built."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return None
    kernel = get_bf16_ops()
    return kernel if kernel is not None and kernel.has_bf16_gemm() else None


class Bf16Linear(nn.Module):
    """y = x @ W^T (+ bias) for bf16 x [..., in] and W [out, in]; build where bf16_gemm_kernel applies."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Any) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.kernel = kernel
        # a OneDnnWeight of the same values for calls of ONEDNN_MIN_ROWS rows or more (AMX CPUs), else None
        self.onednn: Any | None = None
        # a copy packed for AMX tiles, for calls of TILES_MIN_ROWS to TILES_MAX_ROWS rows (AMX CPUs), else None
        self.tiles: AmxTileWeight | None = None
        # else an output head's [out, in] float32 copy for float32 calls of FLOAT32_COPY_MIN_ROWS rows or more (AMX)
        self.float32_copy: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: Any) -> Bf16Linear:
        return cls(linear.weight, linear.bias, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, x.dtype)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """As an output head (llama.py's logits): float32 logits, the kernel's sums not rounded to bf16 (near ties
        stay apart); above KERNEL_MAX_ROWS, F.linear(x, W).float()."""
        return self._forward(x, torch.float32)

    def _forward(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.tiles is not None and rows.dtype == torch.bfloat16 \
                and TILES_MIN_ROWS <= rows.shape[0] <= TILES_MAX_ROWS:
            out = self.tiles.linear(rows, self.bias, out_dtype)
        elif self.onednn is not None and rows.dtype == out_dtype == torch.bfloat16 \
                and rows.shape[0] >= ONEDNN_MIN_ROWS:
            out = self.onednn.linear(rows, self.bias)
        elif self.float32_copy is not None and out_dtype == torch.float32 and rows.dtype == torch.bfloat16 \
                and rows.shape[0] >= FLOAT32_COPY_MIN_ROWS:
            out = bf16_math_linear(rows.float(), self.float32_copy, self.bias)
        elif rows.dtype != torch.bfloat16 or rows.shape[0] > KERNEL_MAX_ROWS:
            out = F.linear(rows, self.weight, self.bias).to(out_dtype)
        else:
            out = torch.empty(rows.shape[0], self.out_features, dtype=out_dtype)
            self.kernel.bf16_linear(out, rows.contiguous(), self.weight.detach(), self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def bf16_math_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight) in float32 with oneDNN's float32 math mode 'bf16' (AMX tiles; inputs rounded to bf16,
    float32 sums): exact products where x and weight hold bf16 values. The mode is restored after the call."""
    precision = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        return F.linear(x, weight, None if bias is None else bias.float())
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = precision
