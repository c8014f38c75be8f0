"""The fused Triton small ops (CUDA's RMSNorm, rotary, SiLU-and-mul) against the torch ops they replace, on
strided views like the model's (q/k heads inside the fused projection), in Triton's interpreter on CPU and
compiled on a GPU. The fused ops compute in float32 and round once; torch rounds after each op, so 16-bit
results agree within the rounding of the dtype, and never stray further from the exact value than torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpilot.model.layers.norm import RMSNorm
from kvpilot.model.layers.rope import rotary_reference
from tests.model.triton_cases import ON_GPU, TRITON_SKIP_REASON

pytestmark = pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def _ops():
    from kvpilot.model.layers import triton_small_ops
    return triton_small_ops


def _fused_projection(num_tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, q 4 heads + k 2 heads + v 2 heads] x head dim 64, as the fused qkv projection lays them out."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, 8 * 64, generator=g).mul(3).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_rows_and_on_head_views(dtype):
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    norm = norm.to(DEVICE, dtype)
    qkv = _fused_projection(5, dtype, seed=1)
    q = qkv[:, :256].view(5, 4, 64)  # token stride 512: not contiguous
    hidden = torch.randn(7, 300, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)  # not a power of 2
    wide = RMSNorm(300, 1e-5).to(DEVICE, dtype)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    for module, x in ((norm, q), (wide, hidden)):
        out = _ops().rms_norm(x, module.weight, module.eps)
        assert out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out, module.reference(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_the_torch_ops(dtype):
    qkv = _fused_projection(6, dtype, seed=3)
    qk = qkv[:, :384].view(6, 6, 64)  # q and k heads rotated together, as the model does without q/k norm
    angles = torch.rand(6, 1, 64, generator=torch.Generator().manual_seed(4)) * 6
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    expected = rotary_reference(qk, cos, sin)
    out = _ops().rotary(qk, cos, sin)
    if dtype == torch.float32:  # a fused multiply-add may round once where torch rounds twice
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        return
    # the sum cancels: torch's rounded products matter at the inputs' scale, not the result's
    scale, eps = qk.abs().max().item(), torch.finfo(dtype).eps
    torch.testing.assert_close(out, expected, rtol=0, atol=eps * scale)
    # computed in float32 and rounded once: within half an ulp of the exact value (torch's three roundings
    # are not, where the sum cancels)
    exact = rotary_reference(qk.double(), cos.double(), sin.double())
    assert ((out.double() - exact).abs() <= 0.5 * eps * exact.abs() + 1e-5 * scale).all()
    assert not ((expected.double() - exact).abs() <= 0.5 * eps * exact.abs() + 1e-5 * scale).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_torch_ops(dtype):
    gate_up = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(5)).mul(4).to(dtype).to(DEVICE)
    gate, up = gate_up.split(1500, dim=-1)
    expected = F.silu(gate) * up
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(_ops().silu_mul(gate_up), expected, rtol=tol, atol=tol)


def test_cuda_tensors_only():
    from kvpilot.model.layers.gpu_small_ops import small_ops_for

    assert small_ops_for(torch.zeros(2, 4)) is None  # CPU tensors keep the C++ or torch ops


@pytest.mark.parametrize("width", [300, 5000])  # one tile; several (the kernel's two passes loop)
def test_fp8_row_quantization_matches_the_torch_ops(width):
    from kvpilot.model.quant.fp8 import FP8_MAX, MIN_SCALE, quantize_rows

    dtype = torch.bfloat16 if ON_GPU else torch.float16
    g = torch.Generator().manual_seed(6)
    rows = (torch.randn(5, width, generator=g) * torch.tensor([[0.01], [1.0], [30.0], [0.0], [500.0]]))
    rows = rows.to(dtype).to(DEVICE)
    q, scale = _ops().quantize_rows_fp8(rows, FP8_MAX, MIN_SCALE)
    expected_q, expected_scale = quantize_rows(rows)
    assert q.dtype == torch.float8_e4m3fn and q.shape == rows.shape and scale.shape == (5, 1)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    assert not q[3].float().any() and 0 < scale[3].item() < 1e-11  # an all-zero row: a finite scale
    got, want = q.float(), expected_q.float()
    if ON_GPU:  # the same rounding of the same quotients: equal but where a division lands on a boundary
        assert (got == want).float().mean() > 0.999
    else:  # the interpreter's e4m3 cast rounds ties away from zero and loses the carry into the exponent
        got = torch.where(want == 2 * got, want, got)
    torch.testing.assert_close(got, want, rtol=0.125, atol=2.0 ** -9)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_and_rotary_in_one_kernel_equal_the_two_kernels(dtype):
    """Qwen3's q/k RMSNorm then rotary, fused: the same roundings as rms_norm then rotary, one launch."""
    qkv = _fused_projection(5, dtype, seed=7)
    qk = qkv[:, :384].view(5, 6, 64)  # 4 q heads + 2 k heads, token stride 512
    g = torch.Generator().manual_seed(8)
    q_weight = torch.rand(64, generator=g).add(0.5).to(dtype).to(DEVICE)
    k_weight = torch.rand(64, generator=g).add(0.5).to(dtype).to(DEVICE)
    angles = torch.rand(5, 1, 64, generator=g) * 6
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    out = _ops().qk_norm_rotary(qk, q_weight, k_weight, 1e-6, 4, cos, sin)
    q = _ops().rotary(_ops().rms_norm(qk[:, :4], q_weight, 1e-6), cos, sin)
    k = _ops().rotary(_ops().rms_norm(qk[:, 4:], k_weight, 1e-6), cos, sin)
    assert out.shape == (5, 6, 64) and out.is_contiguous()
    assert torch.equal(out, torch.cat([q, k], dim=1))
    assert not torch.equal(out[:, :4], _ops().rotary(_ops().rms_norm(qk[:, :4], k_weight, 1e-6), cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_add_and_norm_in_one_kernel_equal_the_two_steps(dtype):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(7, 300, generator=g).mul(2).to(dtype).to(DEVICE)
    residual = torch.randn(7, 300, generator=g).mul(3).to(dtype).to(DEVICE)
    weight = torch.rand(300, generator=g).add(0.5).to(dtype).to(DEVICE)
    total, normed = _ops().add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)  # the residual stream: torch's add, rounded to the dtype
    assert torch.equal(normed, _ops().rms_norm(x + residual, weight, 1e-5))
    assert total.is_contiguous() and normed.is_contiguous()
