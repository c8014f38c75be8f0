"""The fused-experts Triton kernels (CUDA's mixture-of-experts path) against the grouped torch path, in Triton's
interpreter on CPU and compiled on a GPU: the block grouping's invariants, and the result at batch 1 (16-row
blocks, one pair each) and at a batch that fills 64-row blocks, with experts no token chose."""

from __future__ import annotations

import pytest
import torch

from kvpilot.model.layers.moe import grouped_experts, route
from tests.model.triton_cases import ON_GPU, TRITON_SKIP_REASON

pytestmark = pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# bf16 only compiled: the interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def _moe():
    from kvpilot.model.layers import triton_moe
    return triton_moe


def _case(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    hidden, inter = 96, 80  # neither a multiple of the 64-wide tiles
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(num_experts, hidden, inter, generator=g) * 0.1
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, 0] = -30.0  # expert 0 is never chosen
    weights, ids = route(logits, top_k, renormalize=True)
    return [t.to(DEVICE) for t in (x.to(dtype), gate_up.to(dtype), down.to(dtype), weights, ids)]


@pytest.mark.parametrize("num_tokens", [1, 5, 70])
def test_alignment_groups_each_expert_in_whole_blocks(num_tokens):
    *_, ids = _case(num_tokens, 8, 2, torch.float32)
    block_m = 16
    sorted_pairs, block_expert = _moe().align_pairs(ids, 8, block_m)
    pairs, experts, flat = sorted_pairs.cpu().view(-1, block_m), block_expert.cpu(), ids.reshape(-1).cpu()
    num_pairs = flat.numel()
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    for block, expert in zip(pairs, experts.tolist()):
        inside = block[block < num_pairs]
        if expert < 0:
            assert inside.numel() == 0
        else:
            assert (flat[inside.long()] == expert).all() and (inside.diff() > 0).all()
    active = experts[experts >= 0]
    assert (active.diff() >= 0).all() and 0 not in active.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 70])
def test_fused_experts_match_the_grouped_path(dtype, num_tokens):
    x, gate_up, down, weights, ids = _case(num_tokens, 8, 2, dtype, seed=num_tokens)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = (rows.float() @ gate_up[e].float().T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ down[e].float().T

    expected = grouped_experts(x.float(), weights, ids, 8, expert)
    out = _moe().fused_experts(x, gate_up, down, weights, ids)
    assert out.shape == x.shape and out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
