"""GGUF blocks -> the column-tiled int8 copy of the tiled kernels, in C++ (layers/csrc/quant_tile_blocks_cpu.cpp):
the layout of vnni_gemm.tile() (Q8_0 / Q4_0 / Q4_1) and tiled_kquant.ktile() (the formats kept as blocks),
written from the file's blocks straight into tensors allocated once, several matrices (a layer's experts) one after
another. The numpy tile() / ktile() stay the reference (and the dense layers' path).

Invariant: tile_blocks([raw], fmt)'s tensors equal tile() / ktile() of PackedWeight.from_blocks(raw, fmt), byte for
byte, for any bytes (tests/model/test_quant_tile_blocks.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from kvpilot.model.quant.block_decode import tiles_exactly
from kvpilot.model.quant.formats import (IQ4_XS, Q4_1, Q4_K, Q5_1, Q5_K, Q6_K, Q8_0, SUPER_BLOCK_VALUES, TABLE_VALUES,
                                          QuantFormat)
from kvpilot.model.quant.kernel import require_quant_kernel
from kvpilot.model.quant.tiled_kquant import KTiledWeight
from kvpilot.model.quant.vnni_gemm import TILE_ROWS, TiledWeight

_KQUANTS = (Q4_K, Q5_K, Q6_K)


def tile_blocks(matrices: Sequence[np.ndarray], fmt: QuantFormat) -> TiledWeight | KTiledWeight:
    """The tiled copy of the matrices (each uint8 [rows, row bytes] of `fmt`'s blocks, all of one shape, rows a
    multiple of 16), stacked: matrix i's tiles follow matrix i - 1's. ValueError on other shapes, and on MXFP4
    scales that float16 does not hold (block_decode.tiles_exactly)."""
    rows, row_bytes = matrices[0].shape
    if rows % TILE_ROWS or row_bytes % fmt.block_bytes or any(m.shape != (rows, row_bytes) for m in matrices):
        raise ValueError(f"int8 tiles take equal matrices of whole {fmt.name} blocks and a multiple of {TILE_ROWS} "
                         f"rows, not {[m.shape for m in matrices][:4]}")
    if not all(tiles_exactly(m, fmt) for m in matrices):
        raise ValueError("MXFP4 scales outside 2^-24 .. 2^15 have no exact float16 in the int8 tiles")
    per = rows // TILE_ROWS
    tensors = _allocate(fmt, per * len(matrices), row_bytes // fmt.block_bytes * fmt.block_values // 32)
    kernel = require_quant_kernel()
    for i, raw in enumerate(matrices):
        part = [t[i * per:(i + 1) * per] if t.numel() else t for t in tensors]
        kernel.quant_tile_blocks(_read_only_tensor(raw), fmt.code, *part)
    if fmt.kept_as_blocks:
        return KTiledWeight(fmt, *tensors)
    return TiledWeight(*tensors)


def _allocate(fmt: QuantFormat, tiles: int, blocks: int) -> list[torch.Tensor]:
    """(tq, td, to | ts) at the shapes tile() / ktile() give for `tiles` tiles of `blocks` 32-value blocks a row."""
    if not fmt.kept_as_blocks:
        half = torch.empty(tiles, blocks, TILE_ROWS, dtype=torch.float16)
        offsets = torch.empty_like(half) if fmt == Q4_1 else torch.empty(0, dtype=torch.float16)
        return [torch.empty(tiles, blocks, 512 if fmt == Q8_0 else 256, dtype=torch.uint8), half, offsets]
    qbytes = 384 if fmt == Q6_K else 256 if fmt in (Q4_K, IQ4_XS) or fmt.name in TABLE_VALUES else 320
    super_blocks = fmt.block_values == SUPER_BLOCK_VALUES  # the K-quants and IQ4_XS: d a super-block, ts a block
    groups = blocks // 8 if super_blocks else blocks
    width = 32 if fmt in (Q5_1, Q4_K, Q5_K) else 16
    ts_width = 32 if fmt in _KQUANTS else 16
    ts = torch.empty(tiles, blocks, ts_width, dtype=torch.uint8) if super_blocks else torch.empty(0, dtype=torch.uint8)
    return [torch.empty(tiles, blocks, qbytes, dtype=torch.uint8), torch.empty(tiles, groups, width,
                                                                                dtype=torch.float16), ts]


def _read_only_tensor(raw: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over raw's bytes without copying them (a read-only memory map: the kernel only reads it)."""
    array = np.ascontiguousarray(raw, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)
