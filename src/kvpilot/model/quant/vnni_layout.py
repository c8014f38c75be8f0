"""The interleaved copy of a PackedWeight for the int8-activation (VNNI) kernel (layers/csrc/quant_vnni.h).

Blocks go in groups of 8; in a group, each 32-byte chunk holds 4 consecutive values of each of the 8 blocks, so
one vpdpbusd advances 8 blocks' dot products at once and the per-block scaling becomes one vector FMA per 8
blocks. Q4_0/Q4_1 keep their nibbles (4 chunks per group: low nibbles are values 4c..4c+3, high nibbles
16+4c..); Q8_0 stores q + 128 as unsigned bytes (8 chunks). The last KB % 8 blocks of a row keep their own
order. Offsets make every format "d * q + o": Q4_1's m, Q4_0's -8 d, Q8_0's -128 d (exact in float16). A row
takes as many bytes as the GGUF blocks.

Invariant: dequantize_interleaved(interleave(w)) equals w.dequantize().
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.model.quant.formats import BLOCK_VALUES, Q8_0, Q4_0
from kvpilot.model.quant.kernel import require_quant_kernel
from kvpilot.model.quant.packed import PackedWeight

GROUP_BLOCKS = 8


@dataclass(frozen=True)
class InterleavedWeight:
    """vq: uint8 [N, KB * 16] (Q4) or [N, KB * 32] (Q8_0); vd, vo: float16 [N, KB]."""

    vq: torch.Tensor
    vd: torch.Tensor
    vo: torch.Tensor
    q8: bool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.vq, self.vd, self.vo))

    def nbytes_beside(self, w: PackedWeight) -> int:
        """Bytes not shared with `w` (interleave() reuses its scales, and Q4_1's minimums, as they are)."""
        shared = {t.data_ptr() for t in (w.d, w.m) if t is not None}
        return sum(t.numel() * t.element_size() for t in (self.vq, self.vd, self.vo) if t.data_ptr() not in shared)

    def matmul_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [M, N] contiguous = int8-quantized x [M, K] contiguous @ W^T; each float32 or bfloat16."""
        require_quant_kernel().quant_matmul_interleaved(out, x, self.vq, self.vd, self.vo, self.q8)


def interleave(w: PackedWeight) -> InterleavedWeight:
    """The interleaved copy of `w` (built once, at load)."""
    n, kb = w.d.shape
    full = kb // GROUP_BLOCKS * GROUP_BLOCKS
    groups = full // GROUP_BLOCKS
    d = w.d.numpy()
    if w.format == Q8_0:
        offset = (d.astype(np.float32) * -128.0).astype(np.float16)
        q = (w.qs.numpy().view(np.int8).reshape(n, kb, BLOCK_VALUES).astype(np.int16) + 128).astype(np.uint8)
        chunks = q[:, :full].reshape(n, groups, GROUP_BLOCKS, 8, 4).transpose(0, 1, 3, 2, 4)  # [n, G, chunk, block, 4]
    else:
        offset = w.m.numpy() if w.format != Q4_0 else (d.astype(np.float32) * -8.0).astype(np.float16)
        q = w.qs.numpy().reshape(n, kb, 16)
        chunks = q[:, :full].reshape(n, groups, GROUP_BLOCKS, 4, 4).transpose(0, 1, 3, 2, 4)
    vq = np.concatenate([chunks.reshape(n, -1), q[:, full:].reshape(n, -1)], axis=1)
    return InterleavedWeight(torch.from_numpy(np.ascontiguousarray(vq)), torch.from_numpy(np.ascontiguousarray(d)),
                             torch.from_numpy(np.ascontiguousarray(offset)), w.format == Q8_0)


def dequantize_interleaved(v: InterleavedWeight) -> torch.Tensor:
    """float32 [N, K]: the values the layout holds (for tests)."""
    n, kb = v.vd.shape
    full = kb // GROUP_BLOCKS * GROUP_BLOCKS
    groups = full // GROUP_BLOCKS
    raw = v.vq.numpy()
    if v.q8:
        head = raw[:, :full * 32].reshape(n, groups, 8, GROUP_BLOCKS, 4).transpose(0, 1, 3, 2, 4)
        q = np.concatenate([head.reshape(n, full, 32), raw[:, full * 32:].reshape(n, kb - full, 32)], axis=1)
    else:
        head = raw[:, :full * 16].reshape(n, groups, 4, GROUP_BLOCKS, 4).transpose(0, 1, 3, 2, 4)
        nibbles = np.concatenate([head.reshape(n, full, 16), raw[:, full * 16:].reshape(n, kb - full, 16)], axis=1)
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    values = q.astype(np.float32) * v.vd.numpy().astype(np.float32)[:, :, None] + \
        v.vo.numpy().astype(np.float32)[:, :, None]
    return torch.from_numpy(values.reshape(n, -1))
