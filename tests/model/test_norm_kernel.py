"""The C++ bf16 ops compute what the torch ops compute: RMSNorm equal, or one bf16 step apart where the float32
sums (summed in another order) straddle a rounding boundary; the rotary embedding bit for bit; SiLU-and-mul
within one bf16 step. Widths that are not a multiple of 16 (32 for rotations) take the scalar rows."""

import pytest
import torch

from kvpilot.model.layers.cpu_bf16_ops import get_bf16_ops
from kvpilot.model.layers.norm import RMSNorm
from kvpilot.model.layers.rope import apply_rotary, rotary_reference

pytestmark = pytest.mark.skipif(get_bf16_ops() is None, reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (3, 9, 64), (300, 960), (5, 40)])
def test_kernel_matches_the_torch_ops(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen) * 0.5 + 1.0)
    x = (torch.randn(*shape, generator=gen) * 3.0).to(torch.bfloat16)
    with torch.no_grad():
        fused, reference = norm(x), norm.reference(x)
    assert fused.dtype == torch.bfloat16 and fused.shape == x.shape
    differ = fused != reference
    assert float(differ.float().mean()) < 0.01  # almost all bit-identical
    step = reference.float().abs() * 2.0 ** -7  # one bf16 step, relative to the weight times the normed value
    assert bool(((fused.float() - reference.float()).abs() <= 2 * step + 1e-6).all())


def test_float32_and_strided_inputs_keep_the_exact_torch_path() -> None:
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(norm(x), norm.reference(x))  # float32: the torch ops, bit for bit as HF
        bf16 = norm.to(torch.bfloat16)
        wide = torch.randn(4, 128).to(torch.bfloat16)[:, ::2]  # not contiguous: copied first, same values
        assert torch.equal(bf16(wide), bf16(wide.contiguous()))


@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 12, 64), (5, 9, 64), (33, 3, 128), (4, 2, 48)])
def test_rotary_is_bit_for_bit_the_torch_ops(tokens: int, heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens * heads)
    fused = torch.randn(tokens, heads + 2, head_dim, generator=gen).to(torch.bfloat16)
    x = fused[:, :heads]  # a strided slice, as q and k are of the fused qkv projection
    angles = torch.rand(tokens, 1, head_dim, generator=gen) * 6.3
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    out = apply_rotary(x, cos, sin)
    assert out.is_contiguous() and torch.equal(out, rotary_reference(x, cos, sin))


@pytest.mark.parametrize("tokens, intermediate", [(1, 1536), (9, 1536), (40, 24)])
def test_silu_mul_matches_the_torch_ops(tokens: int, intermediate: int) -> None:
    """MLP's silu(gate) * up on the fused gate/up output (a strided slice: rows of 2I). The polynomial exp differs
    from torch's in the last float32 bits, so at most one bf16 step apart, and almost always equal. 24 is not a
    multiple of 16: the scalar rows."""
    gen = torch.Generator().manual_seed(tokens + intermediate)
    gate_up = (torch.randn(tokens, 2 * intermediate, generator=gen) * 4.0).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamp, and both zeros
    fused = get_bf16_ops().silu_mul_bf16(gate_up)
    reference = torch.nn.functional.silu(gate_up[:, :intermediate]).mul_(gate_up[:, intermediate:])
    assert fused.shape == reference.shape and fused.is_contiguous()
    assert float((fused != reference).float().mean()) < 0.01
    step = reference.float().abs() * 2.0 ** -7
    assert bool(((fused.float() - reference.float()).abs() <= step + 1e-30).all())


@pytest.mark.parametrize("rows, width", [(1, 576), (300, 960), (7, 40)])
def test_the_residual_add_fused_into_the_norm_is_the_add_then_the_norm(rows: int, width: int) -> None:
    """add_rms_norm_bf16 (the bf16 CPU layer loop's deferred residual add): the sum is torch's bf16 add, bit for
    bit, and the norm of it the norm kernel's, bit for bit; 40 wide takes the scalar rows."""
    from kvpilot.model.layers.cpu_bf16_ops import residual_ops_for

    gen = torch.Generator().manual_seed(rows + width)
    x, residual = ((torch.randn(rows, width, generator=gen) * 3.0).to(torch.bfloat16) for _ in range(2))
    weight = (torch.randn(width, generator=gen) * 0.5 + 1.0).to(torch.bfloat16)
    ops = residual_ops_for(x, weight)
    assert ops is not None and residual_ops_for(x, weight.float()) is None
    total, normed = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, get_bf16_ops().rms_norm_bf16((x + residual).contiguous(), weight, 1e-5))
