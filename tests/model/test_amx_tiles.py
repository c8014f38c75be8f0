"""Weights packed for AMX tiles (layers/amx_tiles.py, csrc/bf16_gemm_amx.h): the packing against its documented
layout (any CPU), then on a CPU whose kernel module can use the tiles: float32 sums against float64 math, the same
row whatever the other rows of the call, bf16 outputs (+ bias) those sums rounded once as torch rounds, and a dense
bf16 model's projections and head running the tiles for TILES_MIN_ROWS to TILES_MAX_ROWS rows."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot.model.layers.amx_tiles import AmxTileWeight, amx_tiles_kernel, pack_for_tiles
from kvpilot.model.layers.cpu_bf16_ops import get_bf16_ops


def _tiles_kernel():
    kernel = get_bf16_ops()
    if kernel is None or not kernel.has_amx_bf16():
        pytest.skip("this CPU (or the kernel module) cannot use AMX-BF16 tiles")
    return kernel


def test_packing_follows_the_documented_layout():
    n, k = 64, 70  # k padded to 96
    weight = torch.arange(n * k, dtype=torch.float32).reshape(n, k).to(torch.bfloat16)
    packed = pack_for_tiles(weight)
    assert packed.shape == (n // 16, 3, 16, 32)
    for tile, step, pair, column, half in [(0, 0, 0, 0, 0), (1, 2, 5, 3, 1), (3, 1, 15, 15, 0), (2, 0, 7, 9, 1)]:
        value = packed[tile, step, pair, 2 * column + half]
        key = 32 * step + 2 * pair + half
        assert torch.equal(value, weight[16 * tile + column, key] if key < k else torch.tensor(0.0).bfloat16())


def test_only_a_bf16_head_of_whole_32_column_blocks_is_taken():
    kernel = get_bf16_ops()
    assert amx_tiles_kernel(None, torch.zeros(64, 8, dtype=torch.bfloat16)) is None
    assert amx_tiles_kernel(kernel, torch.zeros(48, 8, dtype=torch.bfloat16)) is None
    assert amx_tiles_kernel(kernel, torch.zeros(64, 8, dtype=torch.float32)) is None


@pytest.mark.parametrize("in_features", [576, 70])
def test_tiles_give_float32_sums_of_exact_products_whatever_the_rows(in_features):
    kernel = _tiles_kernel()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1024, in_features, generator=gen).to(torch.bfloat16)
    head = AmxTileWeight(weight, amx_tiles_kernel(kernel, weight))
    x = torch.randn(100, in_features, generator=gen).to(torch.bfloat16)
    full = head.linear(x, None, torch.float32)
    exact = x.double() @ weight.double().t()
    assert full.dtype == torch.float32 and torch.allclose(full.double(), exact, rtol=0, atol=1e-4)
    for rows in (1, 7, 31, 32, 33, 64, 65):  # partial and whole 32-row passes, one and two 64-row sweeps
        assert torch.equal(head.linear(x[:rows], None, torch.float32), full[:rows]), rows
    assert torch.equal(head.linear(x[40:41], None, torch.float32), full[40:41])


def test_bf16_outputs_are_the_float32_sums_plus_bias_rounded_once():
    kernel = _tiles_kernel()
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(960, 576, generator=gen).to(torch.bfloat16)
    bias = torch.randn(960, generator=gen).to(torch.bfloat16)
    tiles = AmxTileWeight(weight, amx_tiles_kernel(kernel, weight))
    for rows in (1, 8, 45, 64, 100):
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        sums = tiles.linear(x, None, torch.float32)
        assert torch.equal(tiles.linear(x), sums.to(torch.bfloat16)), rows
        assert torch.equal(tiles.linear(x, bias), (sums + bias.float()).to(torch.bfloat16)), rows


def test_a_dense_bf16_models_layers_run_on_tiles_between_the_thresholds(tmp_path):
    from kvpilot.fit.model_catalog import get_hf_config
    from kvpilot.model.layers.bf16_linear import TILES_MAX_ROWS, TILES_MIN_ROWS, Bf16Linear
    from kvpilot.model.loader import load_model

    _tiles_kernel()
    config = {**get_hf_config("smollm2-135m"), "num_hidden_layers": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    model = load_model(str(path), load_format="dummy", dtype="bfloat16", max_model_len=64).model
    head = model.output_head
    assert isinstance(head, Bf16Linear) and isinstance(head.tiles, AmxTileWeight) and head.float32_copy is None
    projections = [m for m in model.layers.modules() if isinstance(m, Bf16Linear)]
    assert len(projections) == 8 and all(isinstance(m.tiles, AmxTileWeight) and m.onednn is None for m in projections)
    gen = torch.Generator().manual_seed(1)
    down = model.layers[0].mlp.down_proj
    for layer, out_dtype in ((down, torch.bfloat16), (head, torch.float32)):
        for rows in sorted({max(1, TILES_MIN_ROWS - 1), TILES_MIN_ROWS, 64, TILES_MAX_ROWS, TILES_MAX_ROWS + 1}):
            x = torch.randn(rows, layer.in_features, generator=gen).to(torch.bfloat16)
            got = layer(x) if out_dtype == torch.bfloat16 else layer.forward_float32(x)
            assert torch.equal(got, _by_the_rule(layer, x, out_dtype)), (out_dtype, rows)


def _by_the_rule(layer, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """What Bf16Linear's docstring says a call of x's rows runs: the tiles from TILES_MIN_ROWS to TILES_MAX_ROWS,
    fewer the kernel, more F.linear."""
    from kvpilot.model.layers.bf16_linear import TILES_MAX_ROWS, TILES_MIN_ROWS

    rows = x.shape[0]
    if TILES_MIN_ROWS <= rows <= TILES_MAX_ROWS:
        return layer.tiles.linear(x, None, out_dtype)
    if rows > TILES_MAX_ROWS:
        return torch.nn.functional.linear(x, layer.weight).to(out_dtype)
    out = torch.empty(rows, layer.out_features, dtype=out_dtype)
    layer.kernel.bf16_linear(out, x, layer.weight.detach(), None)
    return out
