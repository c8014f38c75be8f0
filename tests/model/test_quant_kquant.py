"""The formats kept as GGUF blocks (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4) against the gguf package's dequantize-then-matmul
reference on random valid blocks: their values bit for bit (blocks, decoded integers, tiled copies; every ISA path),
the float32 kernel within float32 rounding and the tiled int8 GEMM within the int8 rounding of the activations, for
every row count 1..64 (and a prefill's 300), odd widths (an odd number of blocks and super-blocks, rows that are not
whole tiles), and parts of mixed formats side by side."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from kvpilot.model.quant.block_decode import decode_blocks, decoded_values
from kvpilot.model.quant.formats import BLOCK_FORMATS, PACKED_FORMATS
from kvpilot.model.quant.kernel import best_isa, get_quant_kernel, has_int8_tiles
from kvpilot.model.quant.linear import TILED_MAX_ROWS, DenseScratch, Int8Gate, PackedLinear
from kvpilot.model.quant.packed import PackedWeight
from kvpilot.model.quant.tile_blocks import tile_blocks
from kvpilot.model.quant.tiled_kquant import can_ktile, ktile
from kvpilot.model.quant.tiled_set import TiledSet, tiled_set
from tests.model.kquant_blocks import random_blocks
from tests.model.test_quant_kernels import _fp32_bound, _random_packed

pytestmark = pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")
needs_int8_tiles = pytest.mark.skipif(not has_int8_tiles(), reason="neither AVX-512 VNNI nor AVX2 on this CPU")

NAMES = list(BLOCK_FORMATS)
# 3 super-blocks (odd) for the K-quants and IQ4_XS, 7 blocks (odd, not whole super-blocks) for the 32-value formats
COLS = {name: 768 if BLOCK_FORMATS[name].block_values == 256 else 32 * 7 for name in NAMES}


def _blocks(name: str, rows: int, seed: int) -> tuple[PackedWeight, np.ndarray]:
    """Random valid blocks of `name` as a PackedWeight, and the gguf package's float32 values."""
    raw = random_blocks(name, rows, COLS[name], seed)
    return PackedWeight.from_blocks(raw, BLOCK_FORMATS[name]), dequantize(raw, T[name]).reshape(rows, COLS[name])


def _int8_bound(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """Each 32-value block of x rounds to int8 with its own scale: a dot product moves by at most
    sum_b max|x_b| / 254 * sum |w_b| from the exact one (test_quant_tiled's bound)."""
    rows, cols = x.shape
    w_blocks = torch.from_numpy(np.abs(w)).view(w.shape[0], cols // 32, 32).sum(-1).double()
    return (x.view(rows, cols // 32, 32).abs().amax(-1).double() / 254) @ w_blocks.T + 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_blocks_decode_and_dequantize_exactly(name):
    packed, expected = _blocks(name, 37, seed=1)
    assert packed.shape == (37, COLS[name]) and packed.nbytes == packed.qs.numel()  # the file's bytes
    # the values the tiler takes apart
    assert np.array_equal(decoded_values(decode_blocks(packed.qs.numpy(), packed.format), packed.format), expected)
    for isa in range(best_isa() + 1):
        assert np.array_equal(packed.dequantize(torch.float32, isa).numpy(), expected), isa
        bf16 = packed.dequantize(torch.bfloat16, isa)
        assert torch.equal(bf16, torch.from_numpy(expected).to(torch.bfloat16)), isa


@pytest.mark.parametrize("name", NAMES)
def test_float32_kernel_matches_the_dequantized_reference_for_every_row_count(name):
    packed, w = _blocks(name, 37, seed=2)  # 37 rows: not a multiple of the kernel's 4-row groups
    for rows in range(1, 65):
        x = torch.randn(rows, COLS[name], generator=torch.Generator().manual_seed(rows))
        reference = x.double() @ torch.from_numpy(w).double().T
        bound = _fp32_bound(x, w)
        for isa in range(best_isa() + 1):
            out = torch.empty(rows, 37)
            packed.matmul_into(out, x, isa)
            error = (out.double() - reference).abs()
            assert bool((error <= bound).all()), f"{rows} rows, isa {isa}: max error {error.max():.3g}"


@needs_int8_tiles
@pytest.mark.parametrize("name", NAMES)
def test_the_tiled_copy_holds_the_values_in_about_the_blocks_bytes(name):
    packed, expected = _blocks(name, 48, seed=3)
    copy = tiled_set([packed])
    assert np.array_equal(copy.dequantize().numpy(), expected)
    dense = torch.empty(48, COLS[name], dtype=torch.bfloat16)
    copy.dequantize_into(dense)
    assert torch.equal(dense, torch.from_numpy(expected).to(torch.bfloat16))
    # K-quants' and IQ4_XS's 6-bit sub-scales take a byte each; Q6_K's are int8 already, Q5_0 / Q5_1 keep d (and m)
    # as is; MXFP4's exponent byte becomes a float16 scale (18 bytes a block for 17)
    limits = {"Q4_K": 1.03, "Q5_K": 1.025, "IQ4_XS": 138 / 136, "MXFP4": 18 / 17}
    assert copy.nbytes / packed.nbytes <= limits.get(name, 1.0)
    assert not can_ktile(_blocks(name, 40, seed=4)[0])  # not whole 16-row tiles
    with pytest.raises(ValueError, match="multiple of 16"):
        ktile(_blocks(name, 40, seed=4)[0])


@needs_int8_tiles
@pytest.mark.parametrize("name", NAMES)
def test_tiled_gemm_is_within_the_int8_rounding_of_the_activations(name):
    """1-64 rows (8-row tiles and remainders, pairs of tiles on 4 rows from 16 rows, the third tile alone) and 300,
    float32 and bfloat16 in and out; the argmax folded in the kernel picks the float32 outputs' first maximum."""
    packed, w = _blocks(name, 48, seed=5)
    copy = tiled_set([packed])
    exact_w = torch.from_numpy(w).double()
    for rows in (*range(1, 65), 300):
        x = torch.randn(rows, COLS[name], generator=torch.Generator().manual_seed(rows))
        out = torch.empty(rows, 48)
        copy.matmul_into(out, x)
        diff = (out.double() - x.double() @ exact_w.T).abs()
        assert bool((diff <= _int8_bound(x, w)).all()) and float(diff.max()) > 0, rows
        assert torch.equal(copy.argmax(x), out.argmax(dim=1)), rows
        out_bf16 = torch.empty(rows, 48, dtype=torch.bfloat16)
        copy.matmul_into(out_bf16, x.to(torch.bfloat16))
        reference = torch.empty(rows, 48)
        copy.matmul_into(reference, x.to(torch.bfloat16).float())
        assert torch.equal(out_bf16, reference.to(torch.bfloat16)), rows


@needs_int8_tiles
def test_parts_of_mixed_formats_write_what_each_writes_alone():
    """A fused projection of Q4_K, Q6_K, Q8_0, Q5_K and Q4_1 parts (llama.cpp mixes): one call, each part's columns
    bit for bit what its own tiled copy writes (split formats: the TiledWeight kernel's), values in row order."""
    cols = 768
    parts = [_blocks("Q4_K", 32, seed=6), _blocks("Q6_K", 16, seed=7), _blocks("Q5_K", 16, seed=8)]
    parts += [_random_packed(name, 16, cols, seed=9) for name in ("Q8_0", "Q4_1")]
    copy = tiled_set([p for p, _ in parts])
    assert np.array_equal(copy.dequantize().numpy(), np.concatenate([w for _, w in parts]))
    for rows in (1, 7, 16, 33):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        out = torch.empty(rows, 96, dtype=torch.bfloat16)
        copy.matmul_into(out, x)
        alone = []
        for p, _ in parts:
            single = torch.empty(rows, p.out_features, dtype=torch.bfloat16)
            tiled_set([p]).matmul_into(single, x)
            alone.append(single)
        assert torch.equal(out, torch.cat(alone, dim=1)), rows
        q8 = torch.empty(rows, 16, dtype=torch.bfloat16)
        copy.parts[3].matmul_into(q8, x)  # the Q8_0 part's own TiledWeight kernel
        assert torch.equal(out[:, 64:80], q8), rows


@needs_int8_tiles
def test_packed_linear_takes_the_tiled_set_and_releases_the_blocks():
    """A K-quant layer (packed only): the tiled set in decode steps at every row count, the blocks dropped, steps
    with prompt tokens on the set's values dequantized into the scratch matrix; rows that are not whole tiles keep
    the float32 kernel."""
    packed, w = _blocks("Q4_K", 48, seed=10)
    gate = Int8Gate()
    layer = PackedLinear([packed], bias=False, scratch=DenseScratch(), isa=best_isa(), int8_activations=True,
                         int8_gate=gate)
    assert isinstance(layer.int8_weight, TiledSet) and layer.int8_max_rows == TILED_MAX_ROWS
    layer.release_quants()
    assert layer.quants_released and layer.nbytes == layer.int8_weight.nbytes
    assert torch.equal(layer.weight, torch.from_numpy(w))
    for rows in (1, 40):
        x = torch.randn(rows, 768).to(torch.bfloat16)
        expected = torch.empty(rows, 48, dtype=torch.bfloat16)
        layer.int8_weight.matmul_into(expected, x)
        assert torch.equal(layer(x), expected), rows
        gate.open = False
        assert torch.equal(layer(x), torch.nn.functional.linear(x, torch.from_numpy(w).to(torch.bfloat16))), rows
        gate.open = True
    odd = PackedLinear([_blocks("Q6_K", 40, seed=11)[0]], bias=False, scratch=DenseScratch(), isa=best_isa(),
                       int8_activations=True)
    assert odd.int8_weight is None and not odd.int8_activations


def test_every_packed_format_has_a_kernel_code_of_its_own():
    codes = [f.code for f in PACKED_FORMATS.values()]
    assert sorted(codes) == list(range(len(codes)))
    assert all(f.kept_as_blocks for f in BLOCK_FORMATS.values())


def test_mxfp4_scales_float16_lacks_keep_the_float32_kernel():
    """An MXFP4 exponent outside 2^-24 .. 2^15 has no exact float16 scale in the int8 tiles: such weights are not
    tiled (the float32 kernel computes them, exactly), and the experts' tiler refuses them."""
    raw = random_blocks("MXFP4", 16, 32 * 7, seed=12)
    raw[3, 17 * 2] = 60  # row 3's third block: scale 2^-68
    packed = PackedWeight.from_blocks(raw, BLOCK_FORMATS["MXFP4"])
    expected = dequantize(raw, T.MXFP4).reshape(16, 32 * 7)
    assert 0 < np.abs(expected[3, 64:96]).max() < 1e-18  # the block holds values, tiny ones
    assert not can_ktile(packed)
    assert np.array_equal(packed.dequantize(torch.float32, best_isa()).numpy(), expected)
    with pytest.raises(ValueError, match="no exact float16"):
        tile_blocks([raw], BLOCK_FORMATS["MXFP4"])


@needs_int8_tiles
def test_iq4_xs_tiles_keep_sub_block_scales_that_no_float16_holds():
    """IQ4_XS's sub-block scales d * (ls - 32) (up to 17 significant bits) are no float16 values: the tiles keep d
    and ls - 32 apart and multiply them in float32, so every value comes back exactly, the extreme scales (ls 0 and
    63: -32 d and 31 d) and a d whose products float16 would round included."""
    raw = random_blocks("IQ4_XS", 16, 512, seed=13)
    raw[:, 2:8] = [0x9C, 0x9C, 0xF0, 0x0F, 0xF0, 0x0F]  # the first super-block's ls: 0, 63, 31, 32, 0, 63, 31, 32
    raw[0, 0:2] = np.array([1.0009765625], dtype=np.float16).view(np.uint8)  # d = 1 + 2^-10: 11 significant bits
    packed = PackedWeight.from_blocks(raw, BLOCK_FORMATS["IQ4_XS"])
    expected = dequantize(raw, T.IQ4_XS).reshape(16, 512)
    assert (expected[:, 96:128] == 0).all() and (expected[:, 32:64] != 0).any()  # ls 32: a zero scale
    scales = np.float32(1.0009765625) * np.array([-32, 31, -1], dtype=np.float32)
    assert not np.array_equal(scales.astype(np.float16).astype(np.float32), scales)  # float16 would round them
    copy = tiled_set([packed])
    assert np.array_equal(copy.dequantize().numpy(), expected)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(13))
    out = torch.empty(5, 16)
    copy.matmul_into(out, x)
    diff = (out.double() - x.double() @ torch.from_numpy(expected).double().T).abs()
    assert bool((diff <= _int8_bound(x, expected)).all())
