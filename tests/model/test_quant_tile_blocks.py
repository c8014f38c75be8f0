"""GGUF blocks to int8 tiles in C++ (quant/tile_blocks.py, csrc/quant_tile_blocks_cpu.cpp): byte for byte the numpy
tile() / ktile() of the same blocks, for every format, on random bytes (NaN and infinite scales included), several
matrices stacked, and what PackedExperts holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpilot.model.quant import formats
from kvpilot.model.quant.kernel import get_quant_kernel
from kvpilot.model.quant.packed import PackedWeight
from kvpilot.model.quant.tile_blocks import tile_blocks
from kvpilot.model.quant.tiled_kquant import ktile
from kvpilot.model.quant.vnni_gemm import tile

pytestmark = pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


def _numpy_copy(raw: np.ndarray, fmt) -> list[torch.Tensor]:
    weight = PackedWeight.from_blocks(raw, fmt)
    copy = ktile(weight) if fmt.kept_as_blocks else tile(weight)
    return list(copy.tensors()) if fmt.kept_as_blocks else [copy.tq, copy.td, copy.to]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.float16 else t  # NaNs compared by their bits


@pytest.mark.parametrize("name", FORMATS)
def test_the_kernels_tiles_are_the_numpy_ones_bit_for_bit(name):
    fmt = getattr(formats, name)
    rng = np.random.default_rng(FORMATS.index(name))
    cols = 2 * formats.SUPER_BLOCK_VALUES if fmt.block_values > 32 else 32 * 7  # 2 super-blocks, or 7 blocks
    matrices = [rng.integers(0, 256, (48, cols // fmt.block_values * fmt.block_bytes), dtype=np.uint8)
                for _ in range(3)]
    copy = tile_blocks(matrices, fmt)
    got = list(copy.tensors()) if fmt.kept_as_blocks else [copy.tq, copy.td, copy.to]
    with np.errstate(all="ignore"):  # random float16 scales: NaN and infinite offsets, as the numpy path makes them
        want = [_numpy_copy(raw, fmt) for raw in matrices]
    for i, (have, expected) in enumerate(zip(got, zip(*want))):
        stacked = torch.cat(expected) if expected[0].numel() else expected[0]
        assert have.dtype == stacked.dtype and have.shape == stacked.shape, i
        assert torch.equal(_bits(have), _bits(stacked)), i


def test_shapes_it_cannot_tile_are_refused():
    raw = np.zeros((40, 34 * 2), dtype=np.uint8)  # 40 rows: not whole 16-row tiles
    with pytest.raises(ValueError, match="multiple of 16"):
        tile_blocks([raw], formats.Q8_0)
