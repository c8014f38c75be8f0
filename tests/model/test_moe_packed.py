"""Packed GGUF experts (quant/packed_experts.py): tiny random-weight Qwen3-MoE and Mixtral GGUFs (8 experts, top-2,
tests/model/moe_gguf.py) whose experts are quantized to Q4_0, Q8_0 or a Q4_K_M-like mix (Q4_K gate/up, Q6_K down) stay
packed: greedy tokens in float32 (the float32 packed kernel on the exact dequantized values) equal the same file's
with --quantization none token for token; the int8 path (bf16 on a VNNI CPU: the C++ grouped kernel) stays within
int8 rounding of the dequantized experts and reads only the chosen experts; the held bytes are the file's expert
bytes (int8 copies: as fit's gguf_holding predicts them)."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.fit.gguf_holding import is_expert, packed_bytes
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.fit.model_source import load_model as fit_load
from kvpilot.model.layers.moe import route
from kvpilot.model.loader import load_model
from kvpilot.model.quant.kernel import get_quant_kernel, has_int8_tiles
from kvpilot.model.quant.packed_experts import PackedExperts
from tests.model.moe_gguf import write_moe_gguf

pytestmark = pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")

NEW_TOKENS = 8
# hidden and expert width 256: whole K-quant super-blocks in every row
SMALL = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
         "num_experts_per_tok": 2, "torch_dtype": "float32", "sliding_window": None, "mlp_only_layers": []}
FAMILY = {"qwen3moe": ("qwen3-30b-a3b", {"num_experts": 8, "moe_intermediate_size": 256, "intermediate_size": 512,
                                         "norm_topk_prob": True}),
          "llama": ("mixtral-8x7b", {"num_local_experts": 8, "intermediate_size": 256})}


def _q4_0(name: str) -> str:
    return "Q8_0" if name == "output.weight" else "Q4_0"


def _q8_0(name: str) -> str:
    return "Q8_0"


def _q4_k_m(name: str) -> str:
    """llama.cpp's Q4_K_M pattern: Q6_K for attn_v, ffn_down(_exps) and the head, Q4_K elsewhere."""
    return "Q6_K" if name == "output.weight" or any(k in name for k in ("attn_v", "ffn_down")) else "Q4_K"


def _mxfp4(name: str) -> str:
    """gpt-oss's GGUFs: MXFP4 experts; here IQ4_NL for the rest (both table formats in one file)."""
    return "MXFP4" if "_exps" in name else "IQ4_NL"


MIXES = {"Q4_0": _q4_0, "Q8_0": _q8_0, "Q4_K_M": _q4_k_m, "MXFP4": _mxfp4}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    models = {}
    for arch, (name, family) in FAMILY.items():
        cfg = {**get_hf_config(name), **SMALL, **family}
        cfg.pop("dtype", None)
        folder = tmp_path_factory.mktemp(arch)
        (folder / "config.json").write_text(json.dumps(cfg))
        torch.manual_seed(5)
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32).eval()
        with torch.no_grad():
            for param_name, param in hf.named_parameters():
                param.normal_(1.0 if "norm" in param_name else 0.0, 0.08)
        models[arch] = hf
    return models


@pytest.fixture(scope="module")
def gguf_files(hf_models, tmp_path_factory) -> dict:
    """(arch, mix) -> path: Qwen3-MoE stacked in all three mixes; Mixtral in older files' one tensor per expert."""
    folder = tmp_path_factory.mktemp("moe-gguf")
    files = {}
    for arch, mix in [("qwen3moe", "Q4_0"), ("qwen3moe", "Q8_0"), ("qwen3moe", "Q4_K_M"), ("qwen3moe", "MXFP4"),
                      ("llama", "Q4_K_M")]:
        path = folder / f"{arch}-{mix}.gguf"
        write_moe_gguf(hf_models[arch], path, arch, per_expert=arch == "llama", types=MIXES[mix])
        files[arch, mix] = path
    return files


def _prompts() -> list[list[int]]:
    return [[(i * 37 + j * 11) % 512 for j in range(n)] for i, n in enumerate([1, 9, 30])]


def _experts(llm_or_loaded) -> list[PackedExperts]:
    model = getattr(llm_or_loaded, "loaded", llm_or_loaded).model
    return [m for m in model.modules() if isinstance(m, PackedExperts)]


def _file_expert_bytes(path) -> int:
    return sum(t.num_bytes for t in fit_load(str(path)).gguf.tensors if is_expert(t))


@pytest.mark.parametrize("case", [("qwen3moe", "Q4_0"), ("qwen3moe", "Q8_0"), ("qwen3moe", "Q4_K_M"),
                                  ("qwen3moe", "MXFP4"), ("llama", "Q4_K_M")], ids=lambda c: f"{c[0]}-{c[1]}")
def test_packed_greedy_equals_the_dequantized_model(gguf_files, case):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = {}
    for quantization in ("gguf", "none"):
        llm = LLM(model=str(gguf_files[case]), quantization=quantization, dtype="float32", max_model_len=256,
                  kv_cache_memory="8MiB")
        assert llm.loaded.quantization == quantization
        outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
        if quantization == "gguf":
            experts = _experts(llm)
            assert len(experts) == 2 and all(e.blocks is not None for e in experts)  # float32: the blocks
            memory = llm.loaded.packed_memory
            # the blocks as the file holds them (split formats: the same bytes in separate arrays)
            assert memory.expert_bytes == _file_expert_bytes(gguf_files[case]), memory.summary()
        del llm
    assert outputs["gguf"] == outputs["none"]


def _reference(block, x: torch.Tensor) -> torch.Tensor:
    """The layer on the experts' dequantized values, float32, token by token."""
    experts = block.experts
    weights, ids = route(block.gate(x.float().to(block.gate.weight.dtype)).float(), block.top_k, block.renormalize)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate_up, down = experts.dense_weights(e)
            gate, up = (x[t].float() @ gate_up.T).chunk(2)
            out[t] += w * ((torch.nn.functional.silu(gate) * up) @ down.T)
    return out


@pytest.mark.skipif(not has_int8_tiles(), reason="the int8 path needs AVX-512 VNNI or AVX2")
@pytest.mark.parametrize("mix", ["Q4_0", "Q8_0", "Q4_K_M", "MXFP4"])
def test_int8_experts_hold_the_file_bytes_and_stay_near_the_dequantized_values(gguf_files, mix):
    path = gguf_files["qwen3moe", mix]
    loaded = load_model(str(path), dtype="bfloat16", quantization="gguf", max_model_len=64)
    experts = _experts(loaded)
    assert len(experts) == 2 and all(e.int8_copies is not None and e.blocks is None for e in experts)
    # what fit predicts for the experts' int8 copies, to the byte; about the file's bytes (Q4_0 and Q8_0 copies take
    # the blocks' bytes; Q4_K's 6-bit scales take a byte: 148/144; MXFP4's exponent byte a float16: 18/17)
    tensors = [t for t in fit_load(str(path)).gguf.tensors if is_expert(t)]
    predicted = sum(packed_bytes(t, int8_copy=True) for t in tensors)
    assert loaded.packed_memory.expert_bytes == predicted
    assert 1.0 <= predicted / _file_expert_bytes(path) <= 1.12
    block = loaded.model.layers[0].mlp
    x = (torch.randn(13, 256, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
    with torch.no_grad():
        expected = _reference(block, x)
        for rows in (x[:1], x):  # a batch-1 decode and a step of 13 rows
            out = block(rows)
            assert out.dtype == torch.bfloat16
            error = ((out.float() - expected[:len(rows)]).norm() / expected[:len(rows)].norm()).item()
            assert error < 0.03, error  # int8 activations and a bf16 output: ~1% on these weights


@pytest.mark.skipif(not has_int8_tiles(), reason="the int8 path needs AVX-512 VNNI or AVX2")
def test_a_decode_reads_only_its_chosen_experts(gguf_files):
    """Every expert but the two chosen has its scales set to NaN: the output stays what it was."""
    loaded = load_model(str(gguf_files["qwen3moe", "Q4_K_M"]), dtype="bfloat16", quantization="gguf",
                        max_model_len=64)
    block = loaded.model.layers[1].mlp
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        before = block(x)
        chosen = set(route(block.gate(x).float(), block.top_k, block.renormalize)[1][0].tolist())
        experts = block.experts
        for copy, rows in zip(experts.int8_copies, (256, 256, 256)):
            per = rows // 16
            for e in set(range(8)) - chosen:
                copy.td[e * per:(e + 1) * per] = float("nan")
        after = block(x)
    assert torch.equal(before, after) and bool(torch.isfinite(after).all())


@pytest.mark.skipif(not has_int8_tiles(), reason="the int8 path needs AVX-512 VNNI or AVX2")
def test_bf16_greedy_runs_packed_through_the_engine(gguf_files):
    """The int8 experts under continuous batching, prompts through them too: each prompt's first token is the
    dequantized bf16 model's (later ones may part: int8 rounding flips a near tie on these random weights, measured at
    the 2nd token of one prompt of three, and the rest of that sequence follows it)."""
    path = str(gguf_files["qwen3moe", "Q4_K_M"])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    packed = LLM(model=path, quantization="gguf", dtype="bfloat16", max_model_len=256, kv_cache_memory="8MiB")
    batch = [o.outputs[0].token_ids for o in packed.generate(_prompts(), params)]
    dense = LLM(model=path, quantization="none", dtype="bfloat16", max_model_len=256, kv_cache_memory="8MiB")
    reference = [o.outputs[0].token_ids for o in dense.generate(_prompts(), params)]
    assert [len(tokens) for tokens in batch] == [NEW_TOKENS] * 3
    assert [tokens[0] for tokens in batch] == [tokens[0] for tokens in reference], (batch, reference)


def test_experts_of_one_layer_in_different_types_dequantize(tmp_path):
    """Older Mixtral files keep one tensor per expert, which llama.cpp's quantizer may give different types: packed
    experts take one type a layer and kind, so such a file is dequantized (auto) or refused (gguf)."""
    from kvpilot.model.config import from_hf_config
    from kvpilot.model.errors import ModelLoadError
    from kvpilot.model.quant.model_pack import packed_names

    name, family = FAMILY["llama"]
    config = from_hf_config({**get_hf_config(name), **SMALL, **family}, "tiny")
    expert = "model.layers.{}.mlp.experts.{}.down_proj.weight"
    types = {"lm_head.weight": "Q6_K", expert.format(0, 0): "Q4_K", expert.format(0, 1): "Q4_K",
             expert.format(1, 0): "Q4_K", expert.format(1, 1): "Q6_K"}
    device = torch.device("cpu")
    assert packed_names("auto", device, dict(list(types.items())[:4]), config, tmp_path) == frozenset(types) - {
        expert.format(1, 1)}
    assert packed_names("auto", device, types, config, tmp_path) == frozenset()
    with pytest.raises(ModelLoadError, match="experts of layer 1's down are of different types"):
        packed_names("gguf", device, types, config, tmp_path)
