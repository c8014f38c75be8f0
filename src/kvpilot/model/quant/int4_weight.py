"""Int4Weight: one [N, K] linear weight of 4-bit integers in groups, in one layout whatever checkpoint it came
from (AWQ, GPTQ, compressed-tensors: int4_unpack.py reads each).

w[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n], with q in 0..15 packed 8 to an int32 along K
(GPTQ's own qweight layout: q[k, n] in bits 4 * (k % 8) of qweight[k // 8, n]). Zero points are kept as
integers (GPTQ v1's offset already added: 0..16) and scales in float32 (checkpoints store float16 or
bfloat16: exact), so dequantizing in float32 is exact: |q - zero| <= 16 times an 11-bit mantissa fits in 24.
g_idx says each input column's group: k // group_size for plain checkpoints, a permutation-derived map for
GPTQ act-order (desc_act).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j of a packed int32 holds bits 4j..4j+3


@dataclass
class Int4Weight:
    """qweight int32 [K / 8, N]; scales float32 [G, N]; zeros uint8 [G, N]; g_idx int32 [K] (values < G)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def in_features(self) -> int:
        return int(self.g_idx.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros, self.g_idx))

    def values(self) -> torch.Tensor:
        """q as uint8 [K, N]."""
        return unpack_rows(self.qweight)[: self.in_features].to(torch.uint8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight (exact in float32, then rounded once to `dtype`)."""
        g = self.g_idx.long()
        q = self.values().to(torch.float32)
        w = (q - self.zeros[g].to(torch.float32)) * self.scales[g]
        return w.t().contiguous().to(dtype)

    def to(self, device: torch.device) -> Int4Weight:
        return Int4Weight(*(t.to(device).contiguous() for t in (self.qweight, self.scales, self.zeros, self.g_idx)))

    def same_groups(self, other: Int4Weight) -> bool:
        """Whether both map input columns to groups alike (then they concatenate along N)."""
        return self.scales.shape[0] == other.scales.shape[0] and torch.equal(self.g_idx, other.g_idx)

    @classmethod
    def concat(cls, parts: list[Int4Weight]) -> Int4Weight:
        """Row-wise (output) concatenation of weights with the same K and groups (fused q/k/v, gate/up)."""
        if any(not parts[0].same_groups(p) for p in parts[1:]):
            raise ValueError("only int4 weights with the same g_idx concatenate")
        return cls(torch.cat([p.qweight for p in parts], dim=1), torch.cat([p.scales for p in parts], dim=1),
                   torch.cat([p.zeros for p in parts], dim=1), parts[0].g_idx)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] with 8 nibbles a word, nibble j of row r standing for row 8r + j -> int32 [8R, C]."""
    rows, cols = packed.shape
    nibbles = (packed.unsqueeze(1) >> SHIFTS.to(packed.device).view(1, 8, 1)) & 0xF
    return nibbles.reshape(rows * 8, cols)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] with 8 nibbles a word, nibble j of column c standing for column 8c + j -> int32 [R, 8C]."""
    return unpack_rows(packed.t().contiguous()).t()


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_rows: integer [K, N] in 0..15 (K a multiple of 8) -> int32 [K / 8, N]."""
    k, n = values.shape
    words = (values.to(torch.int64).reshape(k // 8, 8, n) << SHIFTS.to(torch.int64).to(values.device).view(1, 8, 1))
    total = words.sum(dim=1)  # < 2 ** 32: the unsigned word, written back as the int32 of the same bits
    return torch.where(total >= 1 << 31, total - (1 << 32), total).to(torch.int32)

def plain_g_idx(in_features: int, group_size: int | None) -> torch.Tensor:
    """g_idx of a checkpoint without act-order: column k in group k // group_size (None: one group)."""
    cols = torch.arange(in_features, dtype=torch.int32)
    return torch.zeros_like(cols) if group_size is None else cols // group_size
