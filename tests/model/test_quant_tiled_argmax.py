"""Greedy ids folded in a tiled output layer (csrc/quant_tiled_cpu.cpp, PackedLinear.greedy_ids): the argmax of the
float32 values the tiled GEMM writes, first of equal maxima, across thread chunks and partial column blocks; NaN
rows handed back to the caller; and the engine's greedy tokens on the embedded model unchanged by the path."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.model.quant.kernel import best_isa, get_quant_kernel, has_int8_tiles
from kvpilot.model.quant.linear import DenseScratch, Int8Gate, PackedLinear
from kvpilot.model.quant.packed import PackedWeight
from kvpilot.model.quant.vnni_gemm import TiledWeight, tile
from kvpilot.model.sampler import greedy_ids_of
from tests.model.test_quant_kernels import _random_packed

pytestmark = pytest.mark.skipif(get_quant_kernel() is None or not has_int8_tiles(),
                                reason="needs the C++ kernels and AVX-512 VNNI or AVX2")

N, K = 16 * 11, 32 * 7  # 11 tiles: uneven thread chunks, column blocks of 8 tiles and a partial one


def _logits(copy: TiledWeight, x: torch.Tensor) -> np.ndarray:
    out = torch.empty(x.shape[0], copy.td.shape[0] * 16)
    copy.matmul_into(out, x)
    return out.numpy()


def _with_rows(packed: PackedWeight, source: int, targets: list[int]) -> PackedWeight:
    """`packed` with weight rows `targets` replaced by row `source` (bit-identical output columns)."""
    qs, d = packed.qs.clone(), packed.d.clone()
    m = packed.m.clone() if packed.m is not None else None
    for t in targets:
        qs[t], d[t] = qs[source], d[source]
        if m is not None:
            m[t] = m[source]
    return replace(packed, qs=qs, d=d, m=m)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_argmax_is_numpys_of_the_tiled_gemm(name):
    copy = tile(_random_packed(name, N, K, seed=21)[0])
    for rows in (1, 2, 5, 16, 17, 64):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
            ids = copy.argmax(x)
            assert ids.dtype == torch.int64 and ids.shape == (rows,)
            assert np.array_equal(ids.numpy(), _logits(copy, x).argmax(axis=1)), (rows, dtype)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_ties_go_to_the_lowest_id_within_and_across_thread_chunks(name):
    """Rows 150 and 3 copy row 40 (150 in another thread's chunk and column block than 3 and 40), and x is
    row 40's values: the three columns are bit-identical and the largest, so the answer is 3, as numpy's."""
    packed, w = _random_packed(name, N, K, seed=8)
    copy = tile(_with_rows(packed, 40, [150, 3]))
    x = torch.from_numpy(np.stack([w[40], 2 * w[40]]))
    logits = _logits(copy, x)
    assert (logits[:, 3] == logits[:, 150]).all() and (logits.argmax(axis=1) == 3).all()  # the setup holds
    assert copy.argmax(x).tolist() == [3, 3]
    flat = tile(_with_rows(packed, 0, list(range(1, N))))  # every column equal: the first
    assert flat.argmax(x).tolist() == [0, 0]


def test_a_nan_logit_marks_its_row_and_packed_linear_hands_back_none():
    packed, _ = _random_packed("Q8_0", N, K, seed=4)
    d = packed.d.clone()
    d[77, 2] = float("nan")  # column 77 is NaN in every row: numpy's argmax would say 77
    with_nan = replace(packed, d=d)
    copy = tile(with_nan)
    x = torch.randn(3, K)
    assert np.isnan(_logits(copy, x)[:, 77]).all()
    assert copy.argmax(x).tolist() == [-1, -1, -1]
    head = PackedLinear([with_nan], bias=False, scratch=DenseScratch(), isa=best_isa(), keep_dense=True,
                        int8_activations=True)
    assert head.greedy_ids(x.to(torch.bfloat16)) is None  # the runner then takes the logits' argmax


def test_packed_linear_folds_only_where_its_rows_take_the_tiled_copy():
    """An ungated head (Q8_0) at any row count; a gated Q4 layer only while its Int8Gate is open; float32 logits'
    argmax either way."""
    head = PackedLinear([_random_packed("Q8_0", N, K, seed=6)[0]], bias=False, scratch=DenseScratch(), isa=best_isa(),
                        keep_dense=True, int8_activations=True)
    head.release_quants()
    for rows in (1, 9, 300):
        x = torch.randn(rows, K).to(torch.bfloat16)
        assert torch.equal(head.greedy_ids(x), greedy_ids_of(head.forward_float32(x))), rows
    gate = Int8Gate()
    layer = PackedLinear([_random_packed("Q4_1", N, K, seed=7)[0]], bias=False, scratch=DenseScratch(),
                         isa=best_isa(), keep_dense=True, int8_activations=True, int8_gate=gate)
    x = torch.randn(4, K).to(torch.bfloat16)
    assert torch.equal(layer.greedy_ids(x), greedy_ids_of(layer.forward_float32(x)))
    gate.open = False
    assert layer.greedy_ids(x) is None  # the dense bf16 GEMM would compute these rows


def test_engine_greedy_tokens_are_the_same_with_logits_and_argmax():
    """The embedded model in bf16 (its Q8_0 head tiled on a VNNI CPU): greedy decoding of 24 prompts, steps of 24
    rows down to 1, takes the head's argmax (counted) and gives the tokens of float32 logits + argmax."""
    llm = LLM(dtype="bfloat16", max_model_len=256, max_num_seqs=24, kv_cache_memory="256MiB",
              enable_prefix_caching=False)
    model = llm.engine.runner.model
    folded = model.greedy_ids
    calls = []
    model.greedy_ids = lambda hidden: calls.append(hidden.shape[0]) or folded(hidden)
    prompts = [[100 + (11 * i + 5 * j) % 4000 for j in range(2 + 3 * i)] for i in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(24)]
    hidden = torch.randn(7, model.config.hidden_size).to(torch.bfloat16)
    assert torch.equal(folded(hidden), greedy_ids_of(model.logits(hidden)))
    with_head = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert 24 in calls and 1 in calls
    model.greedy_ids = lambda hidden: None  # the runner falls back to the logits
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == with_head
