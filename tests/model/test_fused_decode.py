"""The fused decode path (kvpilot.model.fused_decode: all layers of a small decode-only step in one C++ call)
gives bit for bit the layer-by-layer forward: same greedy tokens and the same float logprobs, on the embedded
model in bf16 and in float32, for steps it runs and steps it leaves to the modules (prefills, more rows than its
limit)."""

from __future__ import annotations

import pytest
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.model.fused_decode import FusedDecode, get_fused_decode_kernel
from kvpilot.model.layers.cpu_bf16_ops import get_bf16_ops
from kvpilot.model.layers.onednn_linear import onednn_bf16_applies

pytestmark = pytest.mark.skipif(get_bf16_ops() is None or get_fused_decode_kernel() is None,
                                reason="no C++ compiler for the CPU kernels")


class CountingKernel:
    """The real kernel, counting its calls (to show the fused path ran)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.calls = 0

    def decode_layers(self, *args):
        self.calls += 1
        return self.kernel.decode_layers(*args)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    """Greedy, with lengths 8, 9, ... so that the batch shrinks step by step."""
    params = [SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True, logprobs=2) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [(p.token_id, p.logprob, tuple(p.top_logprobs)) for p in o.outputs[0].logprobs])
            for o in outputs]


DENSE_BF16 = pytest.param("bfloat16", "none", marks=pytest.mark.skipif(
    not onednn_bf16_applies(torch.bfloat16, torch.device("cpu")), reason="dense bf16 runs oneDNN on AVX-512 only"))


@pytest.mark.parametrize(("dtype", "quantization"),
                         [("bfloat16", "auto"), ("bfloat16", "int4"), ("float32", "auto"), DENSE_BF16])
def test_fused_steps_equal_the_layer_by_layer_forward(dtype, quantization):
    # no prefix caching: the second run must compute exactly what the first did, not reuse its blocks
    llm = LLM(dtype=dtype, quantization=quantization, max_model_len=256, max_num_seqs=48,
              kv_cache_memory="256MiB", enable_prefix_caching=False)
    model = llm.engine.runner.model
    fused = model.fused_decode
    assert isinstance(fused, FusedDecode)
    assert fused.dtype == getattr(torch, dtype)
    counting = CountingKernel(fused.kernel)
    fused.kernel = counting
    # up to 24 prompts: prefill steps, then decode steps of 24 rows down to 1 as requests finish: above the fused
    # path's limit they run the modules (int4, or any format on a CPU without VNNI: 4 rows, the float32 kernel),
    # below it fused (auto on a VNNI CPU: every decode step, the tiled int8 copies' limit being 256). A limit of 4
    # needs only 8 prompts for both kinds of step (the modules' bf16 steps are slow where the CPU lacks bf16).
    # Prompts of 3 to 72 tokens (contexts of 1 to 7 blocks by the last step): the prefill, most of the cost on a
    # CPU, is not what this test is about.
    num_prompts = 24 if fused.max_rows >= 24 else fused.max_rows + 4
    prompts = [[100 + (7 * i + 3 * j) % 4000 for j in range(3 + 3 * i)] for i in range(num_prompts)]
    with_fused = _generate(llm, prompts)
    assert counting.calls >= min(fused.max_rows, len(prompts))
    model.fused_decode = None
    assert _generate(llm, prompts) == with_fused


def test_float32_packed_models_decode_fused(llm_fp32):
    # the HF exactness tests of the embedded model (float32) then check the fused path against transformers
    fused = llm_fp32.engine.runner.model.fused_decode
    assert isinstance(fused, FusedDecode) and fused.dtype == torch.float32 and fused.max_rows >= 1


def test_dense_float32_models_keep_the_modules():
    llm = LLM(dtype="float32", quantization="none", max_model_len=128, kv_cache_memory="64MiB")
    assert llm.engine.runner.model.fused_decode is None
