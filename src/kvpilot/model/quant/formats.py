"""The packed block formats the CPU kernels compute on: GGUF's Q8_0, Q4_0 and Q4_1 (32 values per block), split
into arrays at load, and Q5_0, Q5_1, the K-quants Q4_K, Q5_K, Q6_K and the table formats IQ4_NL, IQ4_XS and MXFP4,
kept as the file's own blocks.

Each format is named by its GGUF type name; `code` is the kernel's enum (layers/csrc/quant_common.h). The block
layouts of the kept formats are GGUF's (documented in the `gguf` package's quants.py): Q5_0 [d][qh: 32 high
bits][16 nibble bytes], Q5_1 the same with a minimum after d, Q4_K [d][dmin][12 bytes of 6-bit scales and
minimums][128 nibble bytes] (8 sub-blocks of 32), Q5_K as Q4_K with 32 bytes of high bits before the nibbles,
Q6_K [128 low-nibble bytes][64 bytes of 2-bit highs][16 int8 scales][d] (16 sub-blocks of 16), IQ4_NL [d][16 bytes
of 4-bit indices into IQ4_NL_VALUES, ordered as Q5_0's nibbles], MXFP4 (gpt-oss's experts) [e: an E8M0 exponent
byte][16 index bytes into MXFP4_VALUES, the E2M1 values doubled; scale 2^(e - 128)], IQ4_XS [d][scales_h: u16, 2
high bits a sub-block][scales_l: 4 bytes, 4 low bits a sub-block][128 index bytes into IQ4_NL_VALUES] (8 sub-blocks
of 32, ordered as IQ4_NL's; sub-block j's scale d * (ls_j - 32), ls_j 6 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_VALUES = 32
SUPER_BLOCK_VALUES = 256


@dataclass(frozen=True)
class QuantFormat:
    """One block format. Split formats (gguf_block_bytes 0): a GGUF block is [d: f16][m: f16 if has_min][qs:
    qs_bytes], kept as separate arrays (PackedWeight.qs / d / m). Kept formats: blocks of `block_values` values in
    `gguf_block_bytes` bytes, held as the file stores them (qs_bytes and has_min unused). The int8 path (AVX-512
    VNNI or AVX2 tiles) holds every format."""

    name: str
    code: int
    qs_bytes: int
    has_min: bool
    block_values: int = BLOCK_VALUES
    gguf_block_bytes: int = 0

    @property
    def kept_as_blocks(self) -> bool:
        return self.gguf_block_bytes > 0

    @property
    def block_bytes(self) -> int:
        if self.kept_as_blocks:
            return self.gguf_block_bytes
        return 2 + (2 if self.has_min else 0) + self.qs_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_values


Q8_0 = QuantFormat("Q8_0", 0, 32, False)
Q4_0 = QuantFormat("Q4_0", 1, 16, False)
Q4_1 = QuantFormat("Q4_1", 2, 16, True)
Q5_0 = QuantFormat("Q5_0", 3, 0, False, BLOCK_VALUES, 22)
Q5_1 = QuantFormat("Q5_1", 4, 0, False, BLOCK_VALUES, 24)
Q4_K = QuantFormat("Q4_K", 5, 0, False, SUPER_BLOCK_VALUES, 144)
Q5_K = QuantFormat("Q5_K", 6, 0, False, SUPER_BLOCK_VALUES, 176)
Q6_K = QuantFormat("Q6_K", 7, 0, False, SUPER_BLOCK_VALUES, 210)
IQ4_NL = QuantFormat("IQ4_NL", 8, 0, False, BLOCK_VALUES, 18)
MXFP4 = QuantFormat("MXFP4", 9, 0, False, BLOCK_VALUES, 17)
IQ4_XS = QuantFormat("IQ4_XS", 10, 0, False, SUPER_BLOCK_VALUES, 136)
# the table formats' values by 4-bit index (ggml's kvalues_iq4nl and kvalues_mxfp4; layers/csrc/quant_common.h)
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
TABLE_VALUES = {"IQ4_NL": IQ4_NL_VALUES, "MXFP4": MXFP4_VALUES}
# the split formats (the gguf package quantizes all three; quant-at-load and the interleaved layout take them)
FORMATS = {f.name: f for f in (Q8_0, Q4_0, Q4_1)}
# the formats kept as GGUF blocks (K-quants, 5-bit, tables): the float32 kernel and the tiled int8 copy take them
BLOCK_FORMATS = {f.name: f for f in (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4, IQ4_XS)}
PACKED_FORMATS = {**FORMATS, **BLOCK_FORMATS}
SUPPORTED_NAMES = ", ".join(PACKED_FORMATS)


def packed_format(type_name: str) -> QuantFormat | None:
    """The packed format of a GGUF tensor type name (e.g. "Q4_K"), or None when the kernels lack it."""
    return PACKED_FORMATS.get(type_name)
