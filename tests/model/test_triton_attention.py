"""The Triton attention backend equals the torch reference backend on small steps: random block placement,
context lengths at block boundaries, a prompt, prefix + chunk, decodes (split and unsplit), GQA groups
1/2/4/8, head dims 64/128/256, fp8 K/V with a per-tensor scale. Without a GPU the kernels run in Triton's
interpreter (TRITON_INTERPRET=1, set by tests.model.triton_cases before they are imported); bfloat16 runs
only on a GPU, since the interpreter computes bf16 dot products wrongly (triton-lang/triton#11584)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.torch_backend import TorchAttentionBackend
from kvpilot.model.layers.paged_attention import write_kv
from tests.model.triton_cases import ON_GPU, TRITON_SKIP_REASON, make_step

pytestmark = pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
BLOCK_SIZE = 8
# (start_position, query_len): a prompt, a one-token prompt, prefix + chunk at and off a block boundary,
# decodes whose contexts end at, just past, and well past block boundaries
SEQS = [(0, 7), (16, 5), (7, 1), (13, 19), (8, 1), (0, 1), (15, 1), (39, 1)]


def _backend(**kwargs):
    from kvpilot.model.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend(**kwargs)


def _run(backend, step, cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, object]:
    kv_heads, num_blocks = cache.shape[1], cache.shape[2]
    backend.kv_cache_shape(num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    meta = backend.build(step.layout, cache.device)  # the reference runs where its cache is (the CPU)
    q, k, v = (t.to(cache.device) for t in (step.q, step.k, step.v))
    return backend.forward(q, k, v, cache, meta, head_dim ** -0.5).cpu(), meta


GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="bfloat16 dots are wrong in Triton's interpreter (#11584)")


@pytest.mark.parametrize("group, head_dim, dtype, partition", [
    (1, 64, torch.float32, None), (2, 64, torch.float16, 16), (4, 128, torch.float32, 16),
    (8, 64, torch.float16, None), (4, 128, torch.float16, 32), (2, 256, torch.float16, 16),
    pytest.param(4, 128, torch.bfloat16, 16, marks=GPU_ONLY),
    pytest.param(8, 256, torch.bfloat16, None, marks=GPU_ONLY)])
def test_matches_torch_backend(group, head_dim, dtype, partition):
    _check_against_torch(group, head_dim, dtype, partition)


def test_64_bit_cache_offsets(monkeypatch):
    """Caches of 2**31 elements or more index K/V with int64 offsets: the same results on that path."""
    from kvpilot.model.attention import triton_decode
    monkeypatch.setattr(triton_decode, "INT32_OFFSET_LIMIT", 0)
    _check_against_torch(2, 64, torch.float32, 16)


def test_prefill_tiles_before_and_on_the_diagonal():
    """Chunks longer than a query tile (the float32 tile is 32 x 32): key tiles wholly before the diagonal and
    whole prefix tiles skip the masks, the diagonal tile and the prefix's partial tile keep them."""
    seqs = [(0, 70), (64, 40), (70, 33), (5, 1)]  # fresh prompt; whole-tile prefix; partial-tile prefix
    _check_against_torch(2, 64, torch.float32, None, seqs)


def _check_against_torch(group: int, head_dim: int, dtype: torch.dtype, partition: int | None,
                         seqs: list[tuple[int, int]] = SEQS) -> None:
    kv_heads = 2
    step = make_step(seqs, group * kv_heads, kv_heads, head_dim, BLOCK_SIZE, dtype, dtype, seed=group)
    ref_cache, cache = step.cache.clone(), step.cache.clone().to(DEVICE)
    ref, _ = _run(TorchAttentionBackend(), step, ref_cache, head_dim)
    out, meta = _run(_backend(decode_partition=partition), step, cache, head_dim)
    longest_decode = max(start + n for start, n in seqs if n == 1 and start > 0)
    assert meta.decode_split.num_splits == (1 if partition is None else -(-longest_decode // max(partition, 16)))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert torch.equal(cache.cpu(), ref_cache)  # the step's K/V written exactly where the reference writes


@pytest.mark.parametrize("kv_scale", [1.0, 0.25])
def test_fp8_kv_with_per_tensor_scale(kv_scale):
    """fp8 cache read as value * scale equals the reference over a float32 cache of those values."""
    heads, kv_heads, head_dim = 4, 2, 64
    step = make_step(SEQS, heads, kv_heads, head_dim, BLOCK_SIZE, torch.float32, torch.float8_e4m3fn, seed=7,
                     kv_scale=kv_scale)
    ref_cache = step.cache.float() * kv_scale
    cache = step.cache.clone().to(DEVICE)
    ref, _ = _run(TorchAttentionBackend(), step, ref_cache, head_dim)
    out, meta = _run(_backend(k_scale=kv_scale, v_scale=kv_scale, decode_partition=16), step, cache, head_dim)
    assert meta.decode_split.num_splits > 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.cpu().float() * kv_scale, ref_cache)


def test_long_decode_splits_across_the_context():
    """One decode over 300 keys in 10 splits of 32, one in a single split: the reduce merges them exactly."""
    step = make_step([(299, 1), (20, 1)], 8, 2, 64, 16, torch.float32, torch.float32, seed=3)
    ref_cache, cache = step.cache.clone(), step.cache.clone().to(DEVICE)
    backend = TorchAttentionBackend()
    meta = backend.build(step.layout, torch.device("cpu"))
    ref = backend.forward(step.q, step.k, step.v, ref_cache, meta, 0.125)
    triton_backend = _backend(decode_partition=32)
    triton_backend.kv_cache_shape(cache.shape[2], 16, 2, 64)
    triton_meta = triton_backend.build(step.layout, DEVICE)
    assert (triton_meta.decode_split.partition_size, triton_meta.decode_split.num_splits) == (32, 10)
    out = triton_backend.forward(step.q.to(DEVICE), step.k.to(DEVICE), step.v.to(DEVICE), cache, triton_meta, 0.125)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


def test_kv_write_skips_negative_slots():
    """Slot -1 (a padded row of a CUDA-graph batch) writes nothing; the others land as torch's write_kv puts them."""
    from kvpilot.model.attention.triton_kv_write import write_kv_triton
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(5, 2, 64, generator=gen), torch.randn(5, 2, 64, generator=gen)
    cache = torch.randn(2, 2, 4, 4, 64, generator=gen)
    slots = torch.tensor([3, -1, 14, 0, 9])
    expected = cache.clone()
    keep = slots >= 0
    write_kv(expected, k[keep], v[keep], slots[keep])
    written = cache.clone().to(DEVICE)
    write_kv_triton(written, k.to(DEVICE), v.to(DEVICE), slots.to(torch.int32).to(DEVICE))
    assert torch.equal(written.cpu(), expected)


def _decode_layout(num_seqs: int, context: int) -> StepLayout:
    tables = np.arange(num_seqs * 8, dtype=np.int64).reshape(num_seqs, 8)
    starts = np.full(num_seqs, context - 1, dtype=np.int64)
    slots = tables[:, (context - 1) // BLOCK_SIZE] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    return StepLayout(np.arange(num_seqs, dtype=np.int64), np.ones(num_seqs, dtype=np.int64), starts, tables,
                      slots, BLOCK_SIZE)


def test_metadata_lands_at_the_same_addresses_for_a_fixed_batch_and_width():
    """What a captured decode graph needs: same batch size and table width -> same device addresses; a
    larger step grows the buffer; reserve() sizes it up front."""
    backend = _backend()
    backend.reserve(max_num_seqs=4, max_num_tokens=16, max_blocks_per_seq=8, device=DEVICE)
    first = backend.build(_decode_layout(4, 20), DEVICE, table_width=8)
    first_ptrs = [t.data_ptr() for t in (first.seq_lens, first.block_tables, first.slot_mapping)]
    second = backend.build(_decode_layout(4, 33), DEVICE, table_width=8)
    assert [t.data_ptr() for t in (second.seq_lens, second.block_tables, second.slot_mapping)] == first_ptrs
    assert second.seq_lens.cpu().tolist() == [33] * 4 and second.block_tables.shape == (4, 8)
    assert second.decode_seqs.cpu().tolist() == [0, 1, 2, 3] and second.prefill_seqs.numel() == 0
    grown = backend.build(_decode_layout(64, 9), DEVICE)
    assert grown.seq_lens.cpu().tolist() == [9] * 64


def test_selector_refuses_triton_where_it_cannot_run(monkeypatch):
    from kvpilot.model.attention.selector import select_attention_backend
    from kvpilot.model.errors import ModelLoadError
    if not ON_GPU:
        with pytest.raises(ModelLoadError, match="bfloat16"):
            select_attention_backend("triton", DEVICE, torch.bfloat16, torch.bfloat16)
        assert select_attention_backend("auto", DEVICE, torch.float32, torch.float32).name != "triton"
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ModelLoadError, match="CUDA device"):
            select_attention_backend("triton", DEVICE, torch.float32, torch.float32)
    else:
        assert select_attention_backend("auto", DEVICE, torch.bfloat16, torch.bfloat16).name == "triton"
