"""The packed block formats the CPU kernels compute on: GGUF's Q8_0, Q4_0 and Q4_1 (32 values per block).

Each format is named by its GGUF type name; `code` is the kernel's enum (layers/csrc/quant_common.h).
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_VALUES = 32


@dataclass(frozen=True)
class QuantFormat:
    """One block format. A GGUF block is [d: f16][m: f16 if has_min][qs: qs_bytes]; block_bytes in all."""

    name: str
    code: int
    qs_bytes: int
    has_min: bool

    @property
    def block_bytes(self) -> int:
        return 2 + (2 if self.has_min else 0) + self.qs_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / BLOCK_VALUES


Q8_0 = QuantFormat("Q8_0", 0, 32, False)
Q4_0 = QuantFormat("Q4_0", 1, 16, False)
Q4_1 = QuantFormat("Q4_1", 2, 16, True)
FORMATS = {f.name: f for f in (Q8_0, Q4_0, Q4_1)}
SUPPORTED_NAMES = ", ".join(FORMATS)


def packed_format(type_name: str) -> QuantFormat | None:
    """The packed format of a GGUF tensor type name (e.g. "Q4_1"), or None when the kernels lack it."""
    return FORMATS.get(type_name)
