"""The output head packed for AMX tiles (layers/amx_head.py, csrc/bf16_gemm_amx.h): the packing against its
documented layout (any CPU), then on a CPU whose kernel module can use the tiles the float32 logits against float64
math, the same row whatever the other rows of the call, and a dense bf16 model's head choosing the tiles from
AMX_HEAD_MIN_ROWS rows."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot.model.layers.amx_head import AmxHeadWeight, amx_head_kernel, pack_for_tiles
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
    assert amx_head_kernel(None, torch.zeros(64, 8, dtype=torch.bfloat16)) is None
    assert amx_head_kernel(kernel, torch.zeros(48, 8, dtype=torch.bfloat16)) is None
    assert amx_head_kernel(kernel, torch.zeros(64, 8, dtype=torch.float32)) is None


@pytest.mark.parametrize("in_features", [576, 70])
def test_tiles_give_float32_sums_of_exact_products_whatever_the_rows(in_features):
    kernel = _tiles_kernel()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1024, in_features, generator=gen).to(torch.bfloat16)
    head = AmxHeadWeight(weight, amx_head_kernel(kernel, weight))
    x = torch.randn(100, in_features, generator=gen).to(torch.bfloat16)
    full = head.linear_float32(x)
    exact = x.double() @ weight.double().t()
    assert full.dtype == torch.float32 and torch.allclose(full.double(), exact, rtol=0, atol=1e-4)
    for rows in (1, 7, 31, 32, 33, 64, 65):  # partial and whole 32-row passes, one and two 64-row sweeps
        assert torch.equal(head.linear_float32(x[:rows]), full[:rows]), rows
    assert torch.equal(head.linear_float32(x[40:41]), full[40:41])


def test_a_dense_bf16_models_head_runs_on_tiles_from_the_threshold(tmp_path):
    from kvpilot.fit.model_catalog import get_hf_config
    from kvpilot.model.layers.bf16_linear import AMX_HEAD_MIN_ROWS, Bf16Linear
    from kvpilot.model.loader import load_model

    _tiles_kernel()
    config = {**get_hf_config("smollm2-135m"), "num_hidden_layers": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    model = load_model(str(path), load_format="dummy", dtype="bfloat16", max_model_len=64).model
    head = model.output_head
    assert isinstance(head, Bf16Linear) and isinstance(head.amx_head, AmxHeadWeight) and head.float32_copy is None
    gen = torch.Generator().manual_seed(1)
    for rows in (AMX_HEAD_MIN_ROWS - 1, AMX_HEAD_MIN_ROWS, 64):
        x = torch.randn(rows, head.in_features, generator=gen).to(torch.bfloat16)
        by_kernel = torch.empty(rows, head.out_features, dtype=torch.float32)
        head.kernel.bf16_linear(by_kernel, x, head.weight.detach(), None)
        expected = by_kernel if rows < AMX_HEAD_MIN_ROWS else head.amx_head.linear_float32(x)
        assert torch.equal(head.forward_float32(x), expected), rows
