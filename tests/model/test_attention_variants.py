"""Attention variants (LayerAttention: sliding window, logit soft-cap, sinks) in every backend against a dense
float64 reference (tests.model.attention_variants): mixed steps of a fresh prompt longer than the window, a
prefix-cached chunk (start > 0), a one-token prompt and decodes, several block sizes, GQA; with a window the
blocks wholly before it hold NaNs (the KV manager may reuse them), which no backend may let through.

Bounds: float32 within 1e-5 (the kernels compute in float32); bfloat16 within 2e-2 (the output rounded to bf16,
relative 2^-8, and the probabilities rounded to bf16 before P.V). The Triton cases run in Triton's interpreter
without a GPU (float32 and float16: its bf16 dots are wrong, triton-lang/triton#11584)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.model.attention.base import (ATTENTION_FEATURES, LayerAttention, StepAttention,
                                          UnsupportedAttentionError)
from kvpilot.model.attention.cpu_backend import CpuKernelAttentionBackend
from kvpilot.model.attention.torch_backend import TorchAttentionBackend
from kvpilot.model.layers.cpu_decode_kernel import get_kernel
from kvpilot.model.layers.cpu_prefill_kernel import get_prefill_kernel
from tests.model.attention_variants import VariantStep, layer_of, variant_step
from tests.model.triton_cases import ON_GPU, TRITON_SKIP_REASON

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
SCALE = HEAD_DIM ** -0.5
# (start_position, query_len): a prompt longer than the window, a prefix-cached chunk whose first query's window
# starts past several blocks, decodes near and far past the window, a one-token prompt
MIXED = [(0, 19), (13, 11), (21, 1), (4, 1), (40, 1), (0, 1)]
DECODES = [(21, 1), (4, 1), (40, 1), (9, 1)]
# every variant alone and together in float32 over blocks of 4; a window over blocks of 16 (a window shorter than
# a block); bfloat16 for the window and all together
CASES = [*((kind, 4, torch.float32) for kind in ("plain", "window", "softcap", "sinks", "all")),
         ("window", 16, torch.float32), ("all", 16, torch.float32), ("all", 4, torch.bfloat16),
         ("window", 16, torch.bfloat16)]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _check(backend, step: VariantStep, layer: LayerAttention, dtype: torch.dtype,
           device: torch.device = torch.device("cpu")) -> None:
    cache = step.cache.clone().to(device)
    if hasattr(backend, "kv_cache_shape"):
        backend.kv_cache_shape(cache.shape[2], cache.shape[3], cache.shape[1], cache.shape[4])
    meta = backend.build(step.layout, device)
    attn = StepAttention(backend, meta)
    out = attn(step.q.to(device), step.k.to(device), step.v.to(device), cache, layer).cpu()
    assert not out.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), step.expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind, block_size, dtype", CASES)
def test_torch_backend(kind, block_size, dtype):
    layer = layer_of(kind, HEADS, SCALE)
    for seqs in (MIXED, DECODES):
        step = variant_step(seqs, HEADS, KV_HEADS, HEAD_DIM, block_size, dtype, layer, seed=block_size)
        _check(TorchAttentionBackend(), step, layer, dtype)


@pytest.mark.skipif(get_kernel() is None, reason="no C++ toolchain: the cpu backend is the torch path")
@pytest.mark.parametrize("kind, block_size, dtype", CASES)
def test_cpu_backend(kind, block_size, dtype):
    """float32: the decode kernel (prompt chunks on the torch path); bf16: the decode and, with AVX512_BF16, the
    prefill kernel."""
    layer = layer_of(kind, HEADS, SCALE)
    for seqs in (MIXED, DECODES):
        step = variant_step(seqs, HEADS, KV_HEADS, HEAD_DIM, block_size, dtype, layer, seed=block_size)
        _check(CpuKernelAttentionBackend(), step, layer, dtype)


@pytest.mark.skipif(get_kernel() is None, reason="no C++ toolchain: the cpu backend is the torch path")
@pytest.mark.parametrize("head_dim, dtype", [(32, torch.float32), (64, torch.float16)])
def test_cpu_decode_kernel_portable_path(head_dim, dtype):
    """Head dims other than 64/128 (and, without AVX-512, every one) take the portable loops."""
    layer = layer_of("all", HEADS, head_dim ** -0.5, window=9)
    step = variant_step(DECODES, HEADS, KV_HEADS, head_dim, 4, dtype, layer, seed=3)
    _check(CpuKernelAttentionBackend(), step, layer, dtype)


@pytest.mark.skipif(get_prefill_kernel() is None, reason="no AVX512_BF16 (or no compiler): no prefill kernel")
@pytest.mark.parametrize("window", [1, 5, 33, 200])
def test_cpu_prefill_kernel_long_chunks(window):
    """Chunks longer than the kernel's 32-key steps, windows shorter and longer than a step, and window 1."""
    layer = LayerAttention(SCALE, sliding_window=window, logit_softcap=1.5,
                           sinks=torch.linspace(-1.0, 2.0, HEADS))
    step = variant_step([(0, 70), (37, 45), (90, 1)], HEADS, KV_HEADS, HEAD_DIM, 16, torch.bfloat16, layer)
    _check(CpuKernelAttentionBackend(), step, layer, torch.bfloat16)


TRITON = pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")


def _triton(**kwargs):
    from kvpilot.model.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend(**kwargs)


@TRITON
@pytest.mark.parametrize("kind, block_size, dtype, partition", [
    ("all", 4, torch.float32, 16), ("window", 16, torch.float16, None), ("sinks", 8, torch.float32, 16),
    ("softcap", 8, torch.float16, None)])
def test_triton_backend(kind, block_size, dtype, partition):
    """partition 16: decodes split across programs (the window skips whole splits; the reduce adds the sinks)."""
    layer = layer_of(kind, HEADS, SCALE, window=7)
    device = torch.device("cuda" if ON_GPU else "cpu")
    if layer.sinks is not None:
        layer = LayerAttention(SCALE, layer.sliding_window, layer.logit_softcap, layer.sinks.to(device))
    step = variant_step(MIXED, HEADS, KV_HEADS, HEAD_DIM, block_size, dtype, layer, seed=block_size)
    _check(_triton(decode_partition=partition), step, layer, dtype, device)


@TRITON
def test_triton_prefill_tiles_with_a_window():
    """A chunk longer than the float32 query tile (32): tiles whose first key is past the prefix and rows that
    see nothing of a key tile."""
    layer = LayerAttention(SCALE, sliding_window=11)
    step = variant_step([(0, 70), (50, 40)], HEADS, KV_HEADS, HEAD_DIM, 8, torch.float32, layer)
    _check(_triton(), step, layer, torch.float32, torch.device("cuda" if ON_GPU else "cpu"))


def test_layer_attention_contract():
    layer = LayerAttention(0.5, sliding_window=4, logit_softcap=30.0, sinks=torch.zeros(8))
    assert layer.features == ATTENTION_FEATURES and (layer.window, layer.softcap) == (4, 30.0)
    plain = LayerAttention(0.5)
    assert plain.features == frozenset() and (plain.window, plain.softcap) == (0, 0.0)
    for bad in (dict(scale=0.0), dict(scale=1.0, sliding_window=0), dict(scale=1.0, logit_softcap=-1.0),
                dict(scale=1.0, sinks=torch.zeros(2, 2)), dict(scale=1.0, sinks=torch.zeros(4, dtype=torch.bfloat16))):
        with pytest.raises(ValueError):
            LayerAttention(**bad)


class _PlainOnly(TorchAttentionBackend):
    name = "plain-only"
    features = frozenset()


def test_a_backend_never_ignores_a_variant_it_lacks():
    step = variant_step(DECODES, HEADS, KV_HEADS, HEAD_DIM, 4, torch.float32, LayerAttention(SCALE))
    backend = _PlainOnly()
    attn = StepAttention(backend, backend.build(step.layout, torch.device("cpu")))
    cache = step.cache.clone()
    attn(step.q, step.k, step.v, cache, SCALE)  # a bare scale: plain attention, as before variants
    with pytest.raises(UnsupportedAttentionError, match="plain-only attention backend does not compute sliding_window"):
        attn(step.q, step.k, step.v, cache, LayerAttention(SCALE, sliding_window=4))


class _WindowOnly(TorchAttentionBackend):
    name = "triton"  # as if the Triton kernels lacked sinks
    features = frozenset({"sliding_window"})


def test_check_backend_features_refuses_or_falls_back(monkeypatch):
    from kvpilot.model.attention import selector
    from kvpilot.model.errors import ModelLoadError

    monkeypatch.setitem(selector.BACKEND_FEATURES, "triton", _WindowOnly.features)
    backend = _WindowOnly()
    assert selector.check_backend_features(backend, frozenset({"sliding_window"}), "triton") is backend
    needed = frozenset({"sliding_window", "sinks"})
    with pytest.raises(ModelLoadError, match=r"triton attention backend does not compute sinks.*"
                                             r"--attention-backend auto or --attention-backend torch or "
                                             r"--attention-backend cpu runs it"):
        selector.check_backend_features(backend, needed, "triton")
    assert isinstance(selector.check_backend_features(backend, needed, "auto"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention features"):
        selector.check_backend_features(backend, frozenset({"alibi"}))
    chosen = selector.select_attention_backend("torch", torch.device("cpu"), torch.float32, torch.float32,
                                               needed=ATTENTION_FEATURES)
    assert chosen.name == "torch"


def test_model_attention_features_reads_the_layers():
    from kvpilot.model.attention.selector import model_attention_features

    layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(3))
    layers[0].layer_attention = LayerAttention(0.1, sliding_window=4)
    layers[1].layer_attention = LayerAttention(0.1, logit_softcap=30.0)
    assert model_attention_features(layers) == frozenset({"sliding_window", "logit_softcap"})
    assert model_attention_features(torch.nn.Linear(2, 2)) == frozenset()


def test_the_fused_decode_path_refuses_attention_variants():
    """Its C++ layer loop runs plain causal attention at head_dim ** -0.5 only."""
    from types import SimpleNamespace

    from kvpilot.model.fused_decode import _plain_attention

    def attn(layer: LayerAttention | None, window: int | None = None) -> SimpleNamespace:
        return SimpleNamespace(head_dim=64, sliding_window=window, layer_attention=layer)

    assert _plain_attention(attn(LayerAttention(0.125))) and _plain_attention(attn(None))
    assert not _plain_attention(attn(LayerAttention(0.125, sliding_window=8), window=8))
    assert not _plain_attention(attn(LayerAttention(0.125, logit_softcap=50.0)))
    assert not _plain_attention(attn(LayerAttention(0.125, sinks=torch.zeros(4))))
    assert not _plain_attention(attn(LayerAttention(0.1)))  # Gemma's query_pre_attn_scalar
    assert not _plain_attention(attn(None, window=8))
