"""The embedded model requantized to llama.cpp's Q4_K_M mix (tests/model/kquant_gguf.py: K-quants with Q5_0 / Q8_0
where rows are not whole super-blocks, fused q/k/v of mixed formats) and to TABLE_MIX (IQ4_NL, MXFP4, Q5_1, Q5_K and
IQ4_XS: the packed formats Q4_K_M leaves out) runs packed: greedy tokens equal the dequantized model's in float32,
the fused decode path equals the layer-by-layer forward bit for bit in bf16 (tiled int8 sets of every format), and
the packed weights take about the file's bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot import LLM, SamplingParams
from kvpilot.model.default_model import default_model_path
from kvpilot.model.fused_decode import FusedDecode, get_fused_decode_kernel
from kvpilot.model.quant.kernel import get_quant_kernel, has_int8_tiles
from kvpilot.model.quant.tiled_set import TiledSet
from tests.model.kquant_gguf import requantize
from tests.model.test_fused_decode import CountingKernel, _generate

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")]

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def kquant_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("kquant")
    files = {}
    for mix in ("Q4_K_M", "TABLE_MIX"):
        files[mix] = folder / f"smollm2.{mix}.gguf"
        requantize(default_model_path(), files[mix], mix)
    return files


def _prompts(llm: LLM) -> list[list[int]]:
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Name three colors."}]]
    return [llm.tokenizer.encode_chat(c) for c in chats] + [llm.tokenizer.encode("def fibonacci(n):")]


@pytest.mark.parametrize("mix", ["Q4_K_M", "TABLE_MIX"])
def test_packed_greedy_equals_the_dequantized_model(kquant_files, mix):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = {}
    for quantization in ("gguf", "none"):
        llm = LLM(model=str(kquant_files[mix]), quantization=quantization, dtype="float32", max_model_len=512,
                  kv_cache_memory="128MiB")
        assert llm.loaded.quantization == quantization
        if quantization == "gguf" and mix == "TABLE_MIX":  # IQ4_XS too
            layers = llm.engine.runner.model.layers
            assert {p.format.name for layer in layers for p in layer.mlp.down_proj.parts} == {"Q5_K", "IQ4_XS"}
        outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(_prompts(llm), params)]
        del llm
    assert outputs["gguf"] == outputs["none"]


# ffn_down's formats, and what the tiled copies take against the file's blocks (TABLE_MIX: MXFP4's 18 bytes for 17)
DOWN_FORMATS = {"Q4_K_M": ({"Q4_K", "Q6_K"}, 1.03), "TABLE_MIX": ({"Q5_K", "IQ4_XS"}, 18 / 17)}


@pytest.mark.skipif(get_fused_decode_kernel() is None or not has_int8_tiles(), reason="no fused kernel or no int8 path")
@pytest.mark.parametrize("mix", ["Q4_K_M", "TABLE_MIX"])
def test_fused_steps_on_mixed_tiled_sets_equal_the_layer_by_layer_forward(kquant_files, mix):
    llm = LLM(model=str(kquant_files[mix]), dtype="bfloat16", quantization="gguf", max_model_len=256,
              max_num_seqs=16, kv_cache_memory="128MiB", enable_prefix_caching=False)
    model = llm.engine.runner.model
    linears = [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.mlp.down_proj)]
    assert any(len(lin.parts) > 1 for lin in linears) and all(isinstance(lin.int8_weight, TiledSet) for lin in linears)
    down_formats, max_ratio = DOWN_FORMATS[mix]
    assert {p.format.name for layer in model.layers for p in layer.mlp.down_proj.parts} == down_formats
    memory = llm.loaded.packed_memory
    assert memory.dense_bytes == 0 and memory.ratio <= max_ratio, memory.summary()  # packed only: tiled copies
    fused = model.fused_decode
    assert isinstance(fused, FusedDecode)
    counting = CountingKernel(fused.kernel)
    fused.kernel = counting
    prompts = [[100 + (7 * i + 3 * j) % 4000 for j in range(3 + 2 * i)] for i in range(12)]
    with_fused = _generate(llm, prompts)
    assert counting.calls >= len(prompts)
    model.fused_decode = None
    assert _generate(llm, prompts) == with_fused
