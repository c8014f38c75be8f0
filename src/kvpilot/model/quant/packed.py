"""PackedWeight: one [N, K] weight matrix kept in its quantized blocks (split formats repacked into kernel-friendly
arrays, the others as the file's blocks).

Invariant: the values are exactly the GGUF blocks' own (`dequantize()` equals the gguf package's
dequantization); only the arrangement differs: for Q8_0 / Q4_0 / Q4_1 scales and quants in separate arrays (see
layers/csrc/quant_common.h), for the formats kept as blocks (formats.BLOCK_FORMATS) the GGUF bytes as they are;
rows in the model's order (Q/K rows un-permuted, fused parts concatenated).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.model.quant.formats import BLOCK_VALUES, QuantFormat
from kvpilot.model.quant.kernel import require_quant_kernel

_EMPTY_HALF = torch.empty(0, dtype=torch.float16)


@dataclass
class PackedWeight:
    """Split formats: qs uint8 [N, K / 32 * qs_bytes]; d (and m for formats with a minimum) float16 [N, K / 32].
    Formats kept as blocks: qs uint8 [N, K / block_values * block_bytes] (the GGUF blocks), d empty, m None, and
    `shape` (N, K), which survives qs being released (PackedLinear.release_quants)."""

    format: QuantFormat
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    shape: tuple[int, int] | None = None

    @property
    def out_features(self) -> int:
        return self.shape[0] if self.shape is not None else int(self.d.shape[0])

    @property
    def in_features(self) -> int:
        return self.shape[1] if self.shape is not None else int(self.d.shape[1]) * BLOCK_VALUES

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    @classmethod
    def from_blocks(cls, raw: np.ndarray, fmt: QuantFormat) -> PackedWeight:
        """From GGUF block bytes: raw uint8 [N, num_blocks * block_bytes] (a GGUF tensor's `data`)."""
        rows = raw.shape[0]
        if fmt.kept_as_blocks:
            blocks = np.array(raw, dtype=np.uint8, order="C").reshape(rows, -1)  # own, writable memory
            cols = blocks.shape[1] // fmt.block_bytes * fmt.block_values
            return cls(fmt, torch.from_numpy(blocks), _EMPTY_HALF, None, (rows, cols))
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, fmt.block_bytes)
        d = blocks[:, :, 0:2].copy().view(np.float16).reshape(rows, -1)
        m = blocks[:, :, 2:4].copy().view(np.float16).reshape(rows, -1) if fmt.has_min else None
        qs = blocks[:, :, fmt.block_bytes - fmt.qs_bytes:].reshape(rows, -1)
        return cls(fmt, torch.from_numpy(np.ascontiguousarray(qs)), torch.from_numpy(d),
                   None if m is None else torch.from_numpy(m))

    @classmethod
    def concat(cls, parts: list[PackedWeight]) -> PackedWeight:
        """Row-wise concatenation of same-format, same-K matrices (fused q/k/v or gate/up)."""
        fmt = parts[0].format
        if any(p.format != fmt or p.in_features != parts[0].in_features for p in parts):
            raise ValueError("only same-format, same-K packed weights concatenate")
        if fmt.kept_as_blocks:
            shape = (sum(p.out_features for p in parts), parts[0].in_features)
            return cls(fmt, torch.cat([p.qs for p in parts]), _EMPTY_HALF, None, shape)
        m = torch.cat([p.m for p in parts]) if fmt.has_min else None  # type: ignore[misc]
        return cls(fmt, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)

    def min_or_empty(self) -> torch.Tensor:
        return _EMPTY_HALF if self.m is None else self.m

    def dequantize_into(self, out: torch.Tensor, isa: int) -> None:
        """Writes the values into out [N, K] (float32 or bfloat16, contiguous)."""
        require_quant_kernel().quant_dequantize(out, self.qs, self.d, self.min_or_empty(), self.format.code, isa)

    def matmul_into(self, out: torch.Tensor, x: torch.Tensor, isa: int) -> None:
        """out [M, N] (unit column stride, may be a column slice) = x [M, K] @ W^T, computed in float32; x and out
        float32 or bfloat16 each."""
        require_quant_kernel().quant_matmul(out, x, self.qs, self.d, self.min_or_empty(), self.format.code, isa)

    def dequantize(self, dtype: torch.dtype = torch.float32, isa: int | None = None) -> torch.Tensor:
        out = torch.empty(self.out_features, self.in_features, dtype=dtype)
        self.dequantize_into(out, require_quant_kernel().cpu_isa() if isa is None else isa)
        return out

