"""The int8 path's column-tiled copy (quant/vnni_gemm.py, csrc/quant_vnni_gemm.h) for Q4_0 / Q4_1 / Q8_0: it holds the
gguf package's values exactly, and its GEMM stays within the int8 rounding of the activations for every row
count (8-row tiles and their remainders), on its own and through PackedLinear and the hybrid layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpilot.model.errors import ModelLoadError
from kvpilot.model.loader import load_model
from kvpilot.model.quant.kernel import best_isa, get_quant_kernel, has_int8_tiles, has_vnni
from kvpilot.model.quant.linear import INT8_MAX_ROWS, TILED_MAX_ROWS, DenseScratch, Int8Gate, PackedLinear
from kvpilot.model.quant.tiled_set import TiledSet, int8_copy
from kvpilot.model.quant.vnni_gemm import TiledWeight, can_tile, dequantize_tiled, tile
from kvpilot.model.quant.vnni_layout import InterleavedWeight
from tests.model.test_quant_kernels import _random_packed

pytestmark = pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")

N, K = 48, 32 * 7  # three 16-row tiles, an odd number of blocks


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_tiled_copy_holds_the_same_values(name):
    packed, expected = _random_packed(name, N, K, seed=3)
    copy = tile(packed)
    assert copy.tq.numel() == packed.qs.numel()  # as many quant bytes as the GGUF blocks
    assert np.array_equal(dequantize_tiled(copy).numpy(), expected)


def test_only_weights_of_whole_tiles_are_tiled():
    assert can_tile(_random_packed("Q8_0", N, K, seed=1)[0])
    odd = _random_packed("Q4_1", N + 4, K, seed=1)[0]
    assert not can_tile(odd)
    with pytest.raises(ValueError, match="multiple of 16"):
        tile(odd)


@pytest.mark.skipif(not has_int8_tiles(), reason="neither AVX-512 VNNI nor AVX2 on this CPU")
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_tiled_gemm_is_within_the_int8_rounding_of_the_activations(name):
    """Each 32-value block of x is rounded to int8 with its own scale: a dot product moves by at most
    sum_b max|x_b| / 254 * sum |w_b| from the exact float32 one (the bound asserted), for 1-9 rows (a tile of 8
    and remainders), 18, 19 and 33 rows (pairs of tiles on 4 rows and remainders, the third tile alone) and 300
    (a prefill's), float32 and bfloat16 in and out."""
    packed, w = _random_packed(name, N, K, seed=11)
    copy = tile(packed)
    w_blocks = torch.from_numpy(np.abs(w)).view(N, K // 32, 32).sum(-1).double()
    exact_w = torch.from_numpy(w).double()
    for rows in (*range(1, 10), 18, 19, 33, 300):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        bound = (x.view(rows, K // 32, 32).abs().amax(-1).double() / 254) @ w_blocks.T + 1e-4
        out = torch.empty(rows, N)
        copy.matmul_into(out, x)
        diff = (out.double() - x.double() @ exact_w.T).abs()
        assert bool((diff <= bound).all()) and float(diff.max()) > 0, rows
        out_bf16 = torch.empty(rows, N, dtype=torch.bfloat16)
        copy.matmul_into(out_bf16, x.to(torch.bfloat16))
        reference = torch.empty(rows, N)
        copy.matmul_into(reference, x.to(torch.bfloat16).float())
        assert torch.equal(out_bf16, reference.to(torch.bfloat16)), rows  # bf16 in = the same values widened


@pytest.mark.skipif(not has_vnni(), reason="no AVX-512 VNNI on this CPU")
def test_packed_linear_takes_the_tiled_copy_in_decode_steps_at_every_row_count():
    """Q4 in whole tiles (hybrid layout): the tiled copy at every row count while the model's Int8Gate is open
    (decode steps), the resident dense bf16 copy while it is closed (steps with prompt tokens); without a gate
    (an output layer, Q8_0 here) the tiled copy always; odd widths keep the interleaved copy up to INT8_MAX_ROWS."""
    packed, w = _random_packed("Q4_1", N, K, seed=5)
    gate = Int8Gate()
    layer = PackedLinear([packed], bias=False, scratch=DenseScratch(), isa=best_isa(), keep_dense=True,
                         int8_activations=True, int8_gate=gate)
    assert isinstance(layer.int8_weight, TiledWeight) and layer.int8_max_rows == TILED_MAX_ROWS
    assert layer.max_kernel_rows[torch.bfloat16] == TILED_MAX_ROWS
    layer.release_quants()
    assert layer.quants_released
    dense = layer._dense(torch.bfloat16)
    assert torch.equal(dense.float(), torch.from_numpy(w).to(torch.bfloat16).float())
    for rows in (1, 8, 40, 600):
        x = torch.randn(rows, K).to(torch.bfloat16)
        expected = torch.empty(rows, N, dtype=torch.bfloat16)
        layer.int8_weight.matmul_into(expected, x)
        assert torch.equal(layer(x), expected), rows
        gate.open = False
        assert torch.equal(layer(x), x @ dense.T), rows
        gate.open = True
    logits = layer.forward_float32(x)  # the kernel's float32 sums, not rounded to bf16
    assert logits.dtype == torch.float32 and torch.equal(logits.to(torch.bfloat16), layer(x))
    q8 = PackedLinear([_random_packed("Q8_0", N, K, seed=6)[0]], bias=False, scratch=DenseScratch(), isa=best_isa(),
                      keep_dense=True, int8_activations=True)
    assert isinstance(q8.int8_weight, TiledWeight) and q8.int8_max_rows == TILED_MAX_ROWS
    q8.release_quants()
    x = torch.randn(300, K).to(torch.bfloat16)
    expected = torch.empty(300, N)
    q8.int8_weight.matmul_into(expected, x)
    assert torch.equal(q8.forward_float32(x), expected)  # ungated: the tiled copy even for 300 rows
    odd = PackedLinear([_random_packed("Q8_0", N + 4, K, seed=7)[0]], bias=False, scratch=DenseScratch(),
                       isa=best_isa(), keep_dense=True, int8_activations=True)
    assert isinstance(odd.int8_weight, InterleavedWeight) and odd.int8_max_rows == INT8_MAX_ROWS


@pytest.mark.skipif(not has_int8_tiles(), reason="neither AVX-512 VNNI nor AVX2 on this CPU")
def test_the_int8_copies_follow_the_cpus_int8_path():
    """A lone Q8_0 / Q4_0 / Q4_1 part of whole tiles gets its tiled copy on every CPU with the int8 path, and so do
    parts of mixed formats (a tiled set; test_quant_kquant.py has the kept formats'); an odd width gets the
    interleaved copy with VNNI, and keeps the float32 kernel without (AVX2): no copy."""
    assert isinstance(int8_copy([_random_packed("Q4_0", N, K, seed=1)[0]]), TiledWeight)
    others = [int8_copy([_random_packed("Q4_1", N, K, seed=3)[0], _random_packed("Q8_0", N, K, seed=4)[0]]),
              int8_copy([_random_packed("Q8_0", N + 4, K, seed=5)[0]])]
    expected = [TiledSet, InterleavedWeight if has_vnni() else type(None)]
    assert [type(c) for c in others] == expected


@pytest.mark.skipif(not has_int8_tiles(), reason="neither AVX-512 VNNI nor AVX2 on this CPU")
def test_auto_runs_the_embedded_gguf_on_the_int8_path():
    """--dtype auto on any CPU with the int8 path (native bf16 or not): bf16 activations, the Int8Gate, and every
    packed layer of the embedded model (Q4_1, its Q8_0 head) on a tiled copy."""
    loaded = load_model(None, max_model_len=64)
    assert loaded.dtype == torch.bfloat16 and loaded.model.int8_gate is not None
    linears = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * 30 + 1 and all(isinstance(m.int8_weight, TiledWeight) for m in linears)


@pytest.mark.skipif(not has_int8_tiles(), reason="neither AVX-512 VNNI nor AVX2 on this CPU")
def test_int8_prompts_take_the_tiled_copies_and_keep_no_dense_copy():
    """--prompt-gemm-dtype int8: the gate stays open in steps with prompt tokens, so a prompt's rows are exactly
    the tiled copy's int8 GEMM (as llama.cpp computes prompts), and no layer keeps a dense copy for them."""
    loaded = load_model(None, dtype="bfloat16", max_model_len=64, prompt_gemm_dtype="int8")
    gate = loaded.model.int8_gate
    assert gate.prompts and loaded.packed_memory.dense_bytes == 0
    gate.for_step(has_prompt_tokens=True)
    assert gate.open
    layer = loaded.model.layers[3].mlp.down_proj
    x = torch.randn(40, layer.in_features, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    expected = torch.empty(40, layer.out_features, dtype=torch.bfloat16)
    layer.int8_weight.matmul_into(expected, x)
    assert torch.equal(layer(x), expected)
    default = load_model(None, dtype="bfloat16", max_model_len=64)
    default.model.int8_gate.for_step(has_prompt_tokens=True)
    assert not default.model.int8_gate.open and default.packed_memory.dense_bytes > 0


def test_int8_prompts_need_the_int8_path():
    with pytest.raises(ModelLoadError, match="prompt-gemm-dtype int8"):
        load_model(None, dtype="float32", max_model_len=64, prompt_gemm_dtype="int8")


def test_kernel_tests_split_their_work_across_threads() -> None:
    """tests/model/conftest.py: two threads or more here, so the kernels' splits across threads run."""
    assert torch.get_num_threads() >= 2
