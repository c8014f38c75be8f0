"""PackedExperts: a mixture-of-experts layer's experts kept in a GGUF's quantized blocks (any packed format:
formats.PACKED_FORMATS), computed grouped by expert without dequantizing; replaces layers.moe.Experts in a
SparseMoeBlock of a packed GGUF model (model_pack.pack_linear_layers).

Two ways to hold and run them, chosen at load:
- int8 (bf16 activations on a CPU with AVX-512 VNNI: the model's Int8Gate exists): one column-tiled int8 copy per
  stacked GGUF tensor (vnni_gemm.py / tiled_kquant.py: gate [E * I, H], up [E * I, H], down [E * H, I], expert after
  expert), written by the kernel from the file's blocks into tensors allocated once (tile_blocks.py) and the blocks
  dropped (the copy is the only one). Every step runs the C++ grouped kernel (layers/csrc/quant_moe_cpu.cpp): the
  pairs sorted by expert, each chosen expert's gate and up tiles times its tokens' int8 rows in one parallel region,
  down with the router weights in a second; a batch-1 decode reads only its top-k experts' tiles. Steps with prompt tokens take it too (the dense layers' Int8Gate does not
  apply): an expert sees only about T * k / E rows of a step, so dequantizing its weights for a bf16 GEMM would cost
  more than the GEMM itself, for every expert a prompt touches.
- blocks (float32 activations, a CPU without VNNI, widths of no whole 16-row tiles, or MXFP4 scales float16 lacks):
  the blocks as PackedWeight, each expert a row range of them, and layers.moe.grouped_experts calls the float32 packed kernel (quant_matmul) on
  each chosen expert's rows: gate and up into one [n, 2I] output, silu(gate) * up, down. In float32 this computes
  with the exact dequantized values (only the order of the sums differs from a dense matmul). Experts with biases
  or another activation (gpt-oss) always run here: biases added after each product, as layers.moe.Experts does.

No dense copy of any expert is ever made (the hybrid layout's dense copies are for the dense layers only).
Invariant: every expert of a kind (gate, up, down) is in one format and all have the same shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from kvpilot.model.layers.moe import grouped_experts, silu_mul
from kvpilot.model.quant.block_decode import tiles_exactly
from kvpilot.model.quant.formats import QuantFormat
from kvpilot.model.quant.kernel import require_quant_kernel
from kvpilot.model.quant.packed import PackedWeight
from kvpilot.model.quant.tile_blocks import tile_blocks
from kvpilot.model.quant.tiled_kquant import KTiledWeight
from kvpilot.model.quant.vnni_gemm import TILE_ROWS, TiledWeight

KINDS = ("gate", "up", "down")
# HF names gguf_weights gives the stacked expert tensors (ffn_{gate,up,down}_exps) of layer i
STACKED_NAME = "model.layers.{layer}.mlp.experts.{kind}_exps.weight"
# ... and older Mixtral files' one tensor per expert (ffn_{gate,up,down}.{j})
PER_EXPERT_NAME = "model.layers.{layer}.mlp.experts.{expert}.{kind}_proj.weight"
_INT8_COPY_TYPES = (TiledWeight, KTiledWeight)


@dataclass(frozen=True)
class ExpertBlocks:
    """One kind of a layer's experts as the GGUF file stores them: per expert a uint8 [rows, row_bytes] array of its
    blocks (views of the file's memory map: nothing is copied until PackedExperts takes them), all of `format`."""

    format: QuantFormat
    experts: tuple[np.ndarray, ...]

    @property
    def rows(self) -> int:
        return int(self.experts[0].shape[0])

    @property
    def cols(self) -> int:
        return int(self.experts[0].shape[1]) // self.format.block_bytes * self.format.block_values

    @property
    def nbytes(self) -> int:
        return sum(int(e.nbytes) for e in self.experts)

    @classmethod
    def stacked(cls, raw: np.ndarray, fmt: QuantFormat, num_experts: int) -> ExpertBlocks:
        """From a stacked tensor's bytes (any shape holding num_experts equal runs of rows)."""
        per_expert = np.asarray(raw, dtype=np.uint8).reshape(num_experts, -1, raw.shape[-1])
        return cls(fmt, tuple(per_expert[e] for e in range(num_experts)))

    @classmethod
    def join(cls, parts: list[ExpertBlocks]) -> ExpertBlocks:
        """Experts of several tensors (one per expert, in expert order) as one kind; ValueError on mixed formats."""
        if len({p.format for p in parts}) != 1 or len({p.experts[0].shape for p in parts}) != 1:
            raise ValueError("one layer's experts of one kind differ in format or shape")
        return cls(parts[0].format, tuple(e for p in parts for e in p.experts))


def expert_blocks_of_layer(packed: dict, layer: int) -> tuple[ExpertBlocks, ExpertBlocks, ExpertBlocks] | None:
    """(gate, up, down) of layer `layer` from the loader's packed tensors (stacked or one tensor per expert), or None
    when the layer has no packed experts."""
    kinds = []
    for kind in KINDS:
        blocks = packed.get(STACKED_NAME.format(layer=layer, kind=kind))
        if blocks is None:
            parts = []
            while (part := packed.get(PER_EXPERT_NAME.format(layer=layer, expert=len(parts), kind=kind))) is not None:
                parts.append(part)
            blocks = ExpertBlocks.join(parts) if parts else None
        kinds.append(blocks)
    if all(k is None for k in kinds):
        return None
    if any(k is None for k in kinds):
        raise ValueError(f"layer {layer} has packed expert tensors of some kinds but not all")
    return kinds[0], kinds[1], kinds[2]


def _tensors(copy: TiledWeight | KTiledWeight) -> list[torch.Tensor]:
    return list(copy.tensors()) if isinstance(copy, KTiledWeight) else [copy.tq, copy.td, copy.to]


def _rows(w: PackedWeight, start: int, stop: int) -> PackedWeight:
    """Rows [start, stop) of `w` (views)."""
    if w.format.kept_as_blocks:
        return replace(w, qs=w.qs[start:stop], shape=(stop - start, w.in_features))
    return replace(w, qs=w.qs[start:stop], d=w.d[start:stop], m=None if w.m is None else w.m[start:stop])


class PackedExperts(nn.Module):
    """Experts' forward (x [T, H], router weights float32 [T, k], expert ids [T, k] -> [T, H] in x's dtype) on
    packed blocks; `int8`: hold and run the column-tiled int8 copies where every kind tiles (see the module
    docstring), else the blocks."""

    def __init__(self, gate: ExpertBlocks, up: ExpertBlocks, down: ExpertBlocks, isa: int, int8: bool, *,
                 bias: bool = False, activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.num_experts = len(gate.experts)
        self.intermediate_size, self.hidden_size = gate.rows, gate.cols
        if not (len(up.experts) == len(down.experts) == self.num_experts and up.rows == gate.rows
                and up.cols == gate.cols and down.rows == gate.cols and down.cols == gate.rows):
            raise ValueError("experts: gate and up [I, H], down [H, I] for every expert")
        self.isa = isa
        self.formats = (gate.format, up.format, down.format)
        tiles = all(k.rows % TILE_ROWS == 0 and all(tiles_exactly(e, k.format) for e in k.experts)
                    for k in (gate, up, down))
        self.int8_copies: tuple[TiledWeight | KTiledWeight, ...] | None = None
        self.blocks: tuple[PackedWeight, ...] | None = None
        # gpt-oss's experts (layers.moe.Experts' variant: biases, its clamped SwiGLU), loaded with the model's other
        # parameters; the grouped C++ kernel has neither, so they run on the blocks
        experts, inter, hidden = self.num_experts, self.intermediate_size, self.hidden_size
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * inter)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden)) if bias else None
        self.activation = activation
        if int8 and tiles and not bias and activation is None:
            self.int8_copies = tuple(tile_blocks(k.experts, k.format) for k in (gate, up, down))
            self._kernel_tensors = [t for copy in self.int8_copies for t in _tensors(copy)]
            self._codes = [f.code for f in self.formats]
        else:
            self.blocks = tuple(PackedWeight.from_blocks(np.concatenate(k.experts), k.format) for k in (gate, up, down))
            inter, hidden = self.intermediate_size, self.hidden_size
            self._experts = [(_rows(self.blocks[0], e * inter, (e + 1) * inter),
                              _rows(self.blocks[1], e * inter, (e + 1) * inter),
                              _rows(self.blocks[2], e * hidden, (e + 1) * hidden)) for e in range(self.num_experts)]

    @property
    def nbytes(self) -> int:
        """The bytes held: the int8 copies or the blocks."""
        if self.int8_copies is not None:
            return sum(c.nbytes for c in self.int8_copies)
        return sum(w.nbytes for w in self.blocks)  # type: ignore[union-attr]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.int8_copies is not None and x.dtype in (torch.float32, torch.bfloat16):
            return require_quant_kernel().quant_moe_tiled(x.contiguous(), self._kernel_tensors, self._codes,
                                                          weights.float().contiguous(), ids.contiguous(),
                                                          self.num_experts)
        if self.blocks is None:
            raise RuntimeError(f"packed experts hold int8 copies, which take float32 or bf16 activations, not {x.dtype}")
        return grouped_experts(x, weights, ids, self.num_experts, self._block_expert)

    def _block_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up, down = self._experts[expert]
        x = (rows if rows.dtype in (torch.float32, torch.bfloat16) else rows.float()).contiguous()
        inter = self.intermediate_size
        gate_up = torch.empty(x.shape[0], 2 * inter, dtype=x.dtype)
        gate.matmul_into(gate_up[:, :inter], x, self.isa)
        up.matmul_into(gate_up[:, inter:], x, self.isa)
        if self.gate_up_proj_bias is not None:
            gate_up += self.gate_up_proj_bias[expert]
        hidden = silu_mul(gate_up) if self.activation is None else self.activation(gate_up)
        out = torch.empty(x.shape[0], self.hidden_size, dtype=x.dtype)
        down.matmul_into(out, hidden.contiguous(), self.isa)
        if self.down_proj_bias is not None:
            out += self.down_proj_bias[expert]
        return out if out.dtype == rows.dtype else out.to(rows.dtype)

    def dense_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) float32: expert `expert`'s values (for tests and inspection)."""
        inter, hidden = self.intermediate_size, self.hidden_size
        if self.int8_copies is None:
            gate, up, down = self._experts[expert]
            return torch.cat([gate.dequantize(), up.dequantize()]), down.dequantize()
        kernel = require_quant_kernel()
        out = []
        for copy, fmt, rows, cols in zip(self.int8_copies, self.formats, (inter, inter, hidden),
                                         (hidden, hidden, inter)):
            per = rows // TILE_ROWS
            part = [t[expert * per:(expert + 1) * per] if t.numel() else t for t in _tensors(copy)]
            values = torch.empty(rows, cols)
            kernel.quant_dequantize_tiled_set(values, part, [fmt.code])
            out.append(values)
        return torch.cat(out[:2]), out[2]

    def extra_repr(self) -> str:
        held = "int8 tiled" if self.int8_copies is not None else "blocks"
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"formats={'/'.join(f.name for f in self.formats)}, {held}")
