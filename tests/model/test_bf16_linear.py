"""The AVX512_BF16 GEMM kernel (csrc/bf16_gemm_avx512.h) and Bf16Linear: float32 sums of bf16 products, rounded
once; each row's result independent of the rows beside it; F.linear beyond the kernel's rows; clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpilot.model.layers.bf16_linear import KERNEL_MAX_ROWS, Bf16Linear, bf16_gemm_kernel

CPU = torch.device("cpu")
KERNEL = bf16_gemm_kernel(torch.bfloat16, CPU)
pytestmark = pytest.mark.skipif(KERNEL is None, reason="this CPU has no AVX512_BF16 (or no C++ compiler)")


def _bf16(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def _run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], dtype=dtype)
    KERNEL.bf16_linear(out, x, w, bias)
    return out


# widths: whole 32-value chunks and a masked tail; outputs: whole 4-row blocks and a short last one; the output
# layer's vocabulary width
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (100, 7), (64, 49_152)])
def test_sums_match_float64_and_bf16_is_the_float32_result_rounded_once(k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k + n)
    w, bias = _bf16(gen, n, k), _bf16(gen, n)
    for rows in (1, 3, 4, 17, KERNEL_MAX_ROWS):
        x = _bf16(gen, rows, k)
        reference = x.double() @ w.double().t()
        got = _run(x, w, None, torch.float32)
        assert torch.allclose(got.double(), reference, rtol=1e-5, atol=1e-4 * k ** 0.5), rows
        with_bias = _run(x, w, bias, torch.float32)
        assert torch.allclose(with_bias, got + bias.float(), rtol=1e-6, atol=1e-5), rows
        assert torch.equal(_run(x, w, bias, torch.bfloat16), with_bias.to(torch.bfloat16)), rows


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    gen = torch.Generator().manual_seed(1)
    w = _bf16(gen, 3072, 576)
    x = _bf16(gen, 37, 576)
    together = _run(x, w, None, torch.float32)
    for row in (0, 5, 36):
        alone = _run(x[row:row + 1].contiguous(), w, None, torch.float32)
        assert torch.equal(alone[0], together[row]), row
        pair = _run(x[row:row + 2].contiguous(), w, None, torch.float32)
        assert torch.equal(pair[0], together[row]), row
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)  # another split of the blocks between threads: the same sums
    try:
        assert torch.equal(_run(x, w, None, torch.float32), together)
    finally:
        torch.set_num_threads(threads)


def test_bf16_linear_takes_any_input_shape_and_hands_many_rows_to_f_linear() -> None:
    gen = torch.Generator().manual_seed(2)
    w, bias = _bf16(gen, 96, 64), _bf16(gen, 96)
    layer = Bf16Linear(torch.nn.Parameter(w, requires_grad=False), torch.nn.Parameter(bias, requires_grad=False),
                       KERNEL)
    wide = _bf16(gen, 2, 5, 128)
    strided = wide[..., ::2]  # rows with a stride, three dimensions
    got = layer(strided)
    assert got.shape == (2, 5, 96) and got.dtype == torch.bfloat16
    assert torch.equal(got.reshape(10, 96), _run(strided.reshape(10, 64).contiguous(), w, bias, torch.bfloat16))
    logits = layer.forward_float32(strided)
    assert logits.dtype == torch.float32 and torch.equal(logits.reshape(10, 96).to(torch.bfloat16), got.reshape(10, 96))
    many = _bf16(gen, KERNEL_MAX_ROWS + 1, 64)
    assert torch.equal(layer(many), F.linear(many, w, bias))
    assert torch.equal(layer.forward_float32(many), F.linear(many, w, bias).float())


def test_wrong_inputs_are_refused_with_a_message() -> None:
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        _run(torch.zeros(2, 64), w, None, torch.float32)
    with pytest.raises(RuntimeError, match="contiguous x and w"):
        _run(torch.zeros(2, 128, dtype=torch.bfloat16)[:, ::2], w, None, torch.float32)
    with pytest.raises(RuntimeError, match="out"):
        KERNEL.bf16_linear(torch.empty(2, 8, dtype=torch.float16), torch.zeros(2, 64, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        _run(torch.zeros(2, 64, dtype=torch.bfloat16), w, torch.zeros(4, dtype=torch.bfloat16), torch.float32)


def test_only_bf16_cpu_weights_take_the_kernel() -> None:
    assert bf16_gemm_kernel(torch.float32, CPU) is None
    assert bf16_gemm_kernel(torch.bfloat16, torch.device("meta")) is None
