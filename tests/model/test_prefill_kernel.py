"""The C++ prefill-attention kernel (bf16, AVX512_BF16) against float32 causal attention over the same bf16
values: prompts from the first token and continued chunks (a prefix hit or chunked prefill) read through a
shuffled block table, GQA, head dims 64 and 128, lengths that are not multiples of its 32-key steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpilot.model.attention.cpu_backend import CpuKernelAttentionBackend
from kvpilot.model.attention.metadata import PrefillSeq
from kvpilot.model.attention.torch_backend import _prefill_mask
from kvpilot.model.layers.cpu_prefill_kernel import get_prefill_kernel
from kvpilot.model.layers.paged_attention import write_kv

pytestmark = pytest.mark.skipif(get_prefill_kernel() is None, reason="no AVX512_BF16 (or no compiler) here")

BLOCK = 16


def _case(heads: int, kv_heads: int, dim: int, start: int, num_query: int, seed: int):
    """A cache holding one sequence's first start + num_query tokens in shuffled blocks, and its queries."""
    g = torch.Generator().manual_seed(seed)
    total = start + num_query
    num_blocks = -(-total // BLOCK) + 3
    cache = torch.zeros(2, kv_heads, num_blocks, BLOCK, dim, dtype=torch.bfloat16)
    block_ids = torch.randperm(num_blocks, generator=g)[: -(-total // BLOCK)]
    slots = torch.cat([block_ids[t // BLOCK:t // BLOCK + 1] * BLOCK + t % BLOCK for t in range(total)])
    k = torch.randn(total, kv_heads, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(total, kv_heads, dim, generator=g).to(torch.bfloat16)
    write_kv(cache, k, v, slots)
    q = torch.randn(num_query, heads, dim, generator=g).to(torch.bfloat16)
    return cache, block_ids, q, k, v


def _reference(q, k, v, start: int, scale: float) -> torch.Tensor:
    """float32 attention of q (positions start..) over keys 0..start + len(q) - 1, causal."""
    n, total = q.shape[0], k.shape[0]
    visible = torch.arange(total)[None, :] <= (start + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], attn_mask=visible, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 2, 64)])
@pytest.mark.parametrize("start,num_query", [(0, 1), (0, 37), (0, 200), (48, 5), (70, 33)])
def test_prefill_kernel_matches_float32_attention(heads, kv_heads, dim, start, num_query):
    cache, block_ids, q, k, v = _case(heads, kv_heads, dim, start, num_query, seed=start * 1000 + num_query)
    scale = dim ** -0.5
    out = torch.empty_like(q)
    get_prefill_kernel().prefill_attention_bf16(out, q, cache[0], cache[1], block_ids, start, scale)
    expected = _reference(q, k, v, start, scale)
    # bf16 output rounding plus the probabilities rounded to bf16 before P.V (relative 2^-8 each)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    assert (out.float() - expected).abs().mean() < 4e-3


def test_the_cpu_backend_runs_prompt_chunks_in_the_kernel():
    """Through the backend (a chunk's rows of a bigger step, queries a strided view): the same values."""
    cache, block_ids, q, k, v = _case(9, 3, 64, 32, 20, seed=1)
    rows = torch.cat([torch.randn(3, 9, 64).to(torch.bfloat16), q, torch.randn(2, 9, 64).to(torch.bfloat16)])
    wide = torch.cat([rows, rows], dim=-1)[..., :64]  # a view whose rows are 2 x 9 x 64 apart
    seq = PrefillSeq(3, 20, 52, block_ids, _prefill_mask(32, 20, torch.device("cpu")))
    out = CpuKernelAttentionBackend().prefill(wide, wide, wide, cache, seq, 0.125)
    expected = torch.empty_like(q)
    get_prefill_kernel().prefill_attention_bf16(expected, q, cache[0], cache[1], block_ids, 32, 0.125)
    assert torch.equal(out, expected)


def _batch_case(spans: list[tuple[int, int]], seed: int):
    """One cache holding several sequences (start, num_query) in shuffled blocks, and all their queries as one
    step's rows: (cache, block ids of each sequence, q of all rows, PrefillSeqs)."""
    g = torch.Generator().manual_seed(seed)
    needs = [-(-(start + n) // BLOCK) for start, n in spans]
    cache = torch.randn(2, 3, sum(needs) + 2, BLOCK, 64, generator=g).to(torch.bfloat16)
    order = torch.randperm(sum(needs) + 2, generator=g)
    tables = list(torch.split(order[:sum(needs)], needs))
    q = torch.randn(sum(n for _, n in spans), 9, 64, generator=g).to(torch.bfloat16)
    starts = [sum(n for _, n in spans[:i]) for i in range(len(spans))]
    seqs = [PrefillSeq(q0, n, start + n, table, None) for q0, (start, n), table in zip(starts, spans, tables)]
    return cache, q, seqs


@pytest.mark.parametrize("window,softcap,sinks", [(0, 0.0, False), (40, 0.0, False), (0, 30.0, True)])
def test_one_call_for_a_steps_chunks_equals_a_call_per_chunk(window, softcap, sinks):
    """prefill_attention_bf16_batch (the backend's forward, one kernel call for the step) gives every row of
    several chunks (prompts from the start, continued chunks, lengths off the 32-key steps) exactly what one call
    per chunk gives, for plain causal attention and the layer variants."""
    from kvpilot.model.attention.base import LayerAttention
    from kvpilot.model.attention.metadata import AttentionMetadata

    cache, q, seqs = _batch_case([(0, 37), (48, 5), (0, 1), (70, 33), (0, 130)], seed=3)
    sink_logits = torch.linspace(-1, 1, 9) if sinks else None
    layer = LayerAttention(scale=0.125, sliding_window=window or None, logit_softcap=softcap or None, sinks=sink_logits)
    none = torch.empty(0, 3, 64, dtype=torch.bfloat16)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), prefills=seqs, decodes=[],
                             num_tokens=q.shape[0])
    # a second KV group's metadata in between (layers alternate groups): each keeps its own kernel arguments
    other = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), prefills=seqs[3:], decodes=[],
                              num_tokens=q.shape[0])
    backend = CpuKernelAttentionBackend()
    first = backend.forward(q, none, none, cache, meta, layer)
    partial = backend.forward(q, none, none, cache, other, layer)
    out = backend.forward(q, none, none, cache, meta, layer)
    assert torch.equal(out, first) and len(backend._spans) == 2
    rows = slice(seqs[3].query_start, None)
    assert torch.equal(partial[rows], out[rows])
    for seq in seqs:
        rows = q[seq.query_start: seq.query_start + seq.query_len]
        alone = torch.empty_like(rows)
        get_prefill_kernel().prefill_attention_bf16_variant(
            alone, rows, cache[0], cache[1], seq.block_ids, seq.context_len - seq.query_len, 0.125, window, softcap,
            sink_logits if sinks else torch.empty(0))
        assert torch.equal(out[seq.query_start: seq.query_start + seq.query_len], alone), seq.query_start
