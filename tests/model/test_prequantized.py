"""Pre-quantized HF checkpoints (AWQ, GPTQ, fp8, compressed-tensors): tiny checkpoints written with the tools'
packing (tests/model/prequantized_checkpoints.py) decode token for token as HF transformers does in float32 on
the dequantized weights, whichever way kvpilot holds them (CPU packed blocks, dense at load, or the CUDA Triton
kernels run in Triton's interpreter); the readers, block mapping and kernels against float32 references; the
errors for unsupported variants and contradicting --quantization values."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.loader import load_model
from kvpilot.model.quant import checkpoint_load
from kvpilot.model.quant.checkpoint_layers import KernelFamily
from kvpilot.model.quant.checkpoint_scheme import Fp8Scheme, Int4Scheme, read_checkpoint_scheme
from kvpilot.model.quant.fp8_checkpoint import Fp8Weight, read_fp8
from kvpilot.model.quant.formats import Q4_0, Q4_1
from kvpilot.model.quant.int4_blocks import block_mapping_problem, offset_error, to_blocks
from kvpilot.model.quant.int4_unpack import read_int4
from kvpilot.model.quant.linear import PackedLinear
from kvpilot.model.quant.prequant_linear import Fp8BlockLinear, Int4Linear
from tests.model.prequantized_checkpoints import (Recipe, awq_tensors, compressed_pack_tensors, fp8_quantize,
                                                  gptq_tensors, quantize_groups, random_hf_model, write_checkpoint)
from tests.model.reference import hf_greedy
from tests.model.triton_cases import TRITON_SKIP_REASON

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 128,
         "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "vocab_size": 256, "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 1,
         "eos_token_id": 2, "rms_norm_eps": 1e-5}
QWEN2 = {**LLAMA, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}  # q/k/v bias
PROMPT_LENGTHS, NEW_TOKENS = (1, 7, 40), 12
F16, BF16 = torch.float16, torch.bfloat16
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _perm_g_idx(k: int, group: int, seed: int) -> torch.Tensor:
    """Act-order g_idx: inputs taken in a random order (GPTQ's descending Hessian diagonal), `group` at a time."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group
    return g_idx


def _input_seed(module: str, differ: bool) -> int:
    """One act-order permutation per layer input (q/k/v and gate/up share theirs, as GPTQ computes them from one
    Hessian), unless `differ`."""
    layer = int(module.split(".")[2])
    proj = module.rsplit(".", 1)[-1]
    shared = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}
    return layer * 100 + (PROJ_INDEX[proj] if differ else shared[proj])


PROJ_INDEX = {p: i for i, p in enumerate(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))}


def awq(group: int) -> Recipe:
    def quantize(module, w):
        g = quantize_groups(w, group, symmetric=False, scale_dtype=F16)
        return awq_tensors(g), g.dequantized()
    return Recipe({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
                  quantize)


def gptq(group: int, sym: bool, v1: bool = True, act_order: bool = False, differ: bool = False) -> Recipe:
    def quantize(module, w):
        g_idx = _perm_g_idx(w.shape[1], group, _input_seed(module, differ)) if act_order else None
        g = quantize_groups(w, group, symmetric=sym, scale_dtype=F16, g_idx=g_idx, min_zero=1 if v1 else 0)
        return gptq_tensors(g, v1), g.dequantized()
    return Recipe({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
                   "checkpoint_format": "gptq" if v1 else "gptq_v2"}, quantize)


def compressed_int4(group: int | None, symmetric: bool, act_order: bool = False) -> Recipe:
    def quantize(module, w):
        g_idx = _perm_g_idx(w.shape[1], group, _input_seed(module, False)) if act_order else None
        g = quantize_groups(w, group, symmetric=symmetric, scale_dtype=BF16, g_idx=g_idx)
        return compressed_pack_tensors(g, symmetric, act_order), g.dequantized()
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group" if group else "channel",
               "group_size": group, "actorder": "group" if act_order else None, "dynamic": False}
    return Recipe(_compressed_config("pack-quantized", weights, None), quantize)


def _compressed_config(fmt: str, weights: dict, activations: dict | None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def fp8_blocks() -> Recipe:
    """Qwen's -FP8 / DeepSeek's layout: 128x128 blocks, `weight_scale_inv`, dynamic activations."""
    def quantize(module, w):
        q, scale, deq = fp8_quantize(w, (128, 128))
        return {"weight": q, "weight_scale_inv": scale}, deq
    return Recipe({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}, quantize)


def fp8_per_tensor() -> Recipe:
    """AutoFP8's layout: one weight_scale a tensor and a static input_scale (which kvpilot ignores)."""
    def quantize(module, w):
        q, scale, deq = fp8_quantize(w, tuple(w.shape))
        return {"weight": q, "weight_scale": scale.reshape(()), "input_scale": torch.tensor(0.05)}, deq
    return Recipe({"quant_method": "fp8", "activation_scheme": "static"}, quantize)


def compressed_fp8(strategy: str) -> Recipe:
    def quantize(module, w):
        block = {"tensor": tuple(w.shape), "channel": (1, w.shape[1]), "block": (128, 128)}[strategy]
        q, scale, deq = fp8_quantize(w, block)
        return {"weight": q, "weight_scale": scale.reshape(1) if strategy == "tensor" else scale}, deq
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
               "block_structure": [128, 128] if strategy == "block" else None}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    return Recipe(_compressed_config("float-quantized", weights, activations), quantize)


def _checkpoint(tmp_path, cfg: dict, recipe: Recipe, name: str = "ckpt"):
    model = random_hf_model(cfg)
    write_checkpoint(model, tmp_path / name, recipe)
    return model, tmp_path / name


def _assert_decodes_like_hf(llm: LLM, hf, label: str, lengths: tuple[int, ...] = PROMPT_LENGTHS,
                            new_tokens: int = NEW_TOKENS) -> None:
    prompts = [[(i * 37 + j * 11 + 3) % LLAMA["vocab_size"] for j in range(n)] for i, n in enumerate(lengths)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, new_tokens), \
            f"{label}: the prompt of {len(prompt)} tokens diverged from transformers on the dequantized weights"


CPU_CASES = {
    # name: (config, recipe, how the decoder projections are held, block format)
    "awq-g32": (LLAMA, awq(32), "packed", Q4_1),
    "gptq-v1-sym-g64-qkv-bias": (QWEN2, gptq(64, sym=True), "packed", Q4_0),
    "gptq-v2-asym-g128": (LLAMA, gptq(128, sym=False, v1=False), "packed", Q4_1),
    "gptq-v1-asym-act-order": (LLAMA, gptq(32, sym=False, act_order=True), "dense", None),
    "compressed-w4a16-sym-g32": (LLAMA, compressed_int4(32, symmetric=True), "packed", Q4_0),
    "compressed-w4a16-asym-channel": (QWEN2, compressed_int4(None, symmetric=False), "packed", Q4_1),
    "fp8-blocks-128": (LLAMA, fp8_blocks(), "dense", None),
    "fp8-per-tensor-static": (QWEN2, fp8_per_tensor(), "dense", None),
    "compressed-fp8-channel": (LLAMA, compressed_fp8("channel"), "dense", None),
}


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_cpu_decodes_like_transformers_on_the_dequantized_weights(case, tmp_path, caplog):
    cfg, recipe, held, fmt = CPU_CASES[case]
    hf, path = _checkpoint(tmp_path, cfg, recipe)
    with caplog.at_level(logging.INFO, logger="kvpilot"):
        llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory="16MiB", max_model_len=256)
    method = recipe.quantization_config["quant_method"]
    assert llm.loaded.checkpoint_quantization == method
    qkv = llm.loaded.model.layers[0].self_attn.qkv_proj
    if held == "packed":
        assert llm.loaded.quantization == method and isinstance(qkv, PackedLinear)
        assert [p.format for p in qkv.parts] == [fmt]  # q, k and v fused into one block matrix
    else:
        assert llm.loaded.quantization == "none" and isinstance(qkv, torch.nn.Linear)
        assert "dequantized to float32 at load" in caplog.text
    _assert_decodes_like_hf(llm, hf, case)


TRITON_CASES = {
    # act-order with q/k/v permutations that differ: the fused layer keeps its three parts apart
    "gptq-g64-act-order-parts-apart": (QWEN2, gptq(64, sym=False, act_order=True, differ=True), Int4Linear, 3),
    # q/k/v of 128, 64 and 64 rows in 128-row blocks: fused with a scale row per weight row
    "fp8-blocks-128": (LLAMA, fp8_blocks(), Fp8BlockLinear, 1),
}


@pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_cuda_kernels_decode_like_transformers(case, tmp_path, monkeypatch):
    """The layers CUDA holds (Int4Linear, Fp8BlockLinear: Triton, weight-only) built on CPU and run in the
    interpreter, float32; torch's fp8 matmul left out (it quantizes activations: not token-exact)."""
    if torch.cuda.is_available():
        pytest.skip("runs the CUDA layers on CPU in Triton's interpreter")
    cfg, recipe, module_class, num_parts = TRITON_CASES[case]
    hf, path = _checkpoint(tmp_path, cfg, recipe)
    monkeypatch.setattr(checkpoint_load, "kernel_family",
                        lambda device: KernelFamily("cuda", triton=True, fp8_e4m3=True, fp8_matmul=False))
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory="16MiB", max_model_len=256)
    qkv = llm.loaded.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, module_class) and len(qkv.parts) == num_parts
    _assert_decodes_like_hf(llm, hf, case, lengths=(1, 19), new_tokens=8)  # the interpreter is slow


def _odd_groups(layout: str, n: int = 40, k: int = 96, seed: int = 0):
    """A weight off every tile size, its groups, and the checkpoint tensors `layout` writes for it."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    if layout == "awq":
        g = quantize_groups(w, 32, False, F16)
        return g, awq_tensors(g), Int4Scheme("awq", "awq", 32, symmetric=False)
    if layout == "gptq-v1-act-order":
        g = quantize_groups(w, 32, False, F16, g_idx=_perm_g_idx(k, 32, seed), min_zero=1)
        return g, gptq_tensors(g, v1=True), Int4Scheme("gptq", "gptq", 32, False, zero_offset=1, act_order=True)
    if layout == "gptq-v2-sym":
        g = quantize_groups(w, 64, True, F16)
        return g, gptq_tensors(g, v1=False), Int4Scheme("gptq", "gptq", 64, True)
    symmetric = layout == "pack-sym"
    g = quantize_groups(w, None if symmetric else 32, symmetric, BF16)
    return g, compressed_pack_tensors(g, symmetric, False), \
        Int4Scheme("compressed-tensors", "pack", None if symmetric else 32, symmetric)


@pytest.mark.parametrize("layout", ["awq", "gptq-v1-act-order", "gptq-v2-sym", "pack-sym", "pack-asym"])
def test_readers_give_the_packed_values_exactly(layout):
    groups, tensors, scheme = _odd_groups(layout)
    weight = read_int4(tensors, scheme, layout)
    assert torch.equal(weight.dequantize(torch.float32), groups.dequantized())


def _block_values(blocks) -> torch.Tensor:
    """float32 [N, K] from Q4_0 / Q4_1 PackedWeight arrays (GGUF nibble order: 16 low nibbles, then the highs)."""
    n, kb = blocks.d.shape
    raw = blocks.qs.reshape(n, kb, 16)
    q = torch.cat([raw & 0xF, raw >> 4], dim=-1).to(torch.float32)
    d = blocks.d.to(torch.float32).unsqueeze(-1)
    values = d * q + (blocks.m.to(torch.float32).unsqueeze(-1) if blocks.m is not None else -8 * d)
    return values.reshape(n, kb * 32)


@pytest.mark.parametrize("layout", ["awq", "gptq-v2-sym", "pack-sym", "pack-asym"])
def test_groups_map_onto_blocks_of_32(layout):
    groups, tensors, scheme = _odd_groups(layout, n=48, k=128)
    weight = read_int4(tensors, scheme, layout)
    blocks = to_blocks(weight)
    values, exact = _block_values(blocks), groups.dequantized()
    if blocks.format == Q4_0:  # symmetric: d * (q - 8) is the checkpoint's own arithmetic
        assert torch.equal(values, exact)
        return
    # Q4_1's minimum -scale * zero is rounded to float16: at most half its last place off
    bound = (groups.scales * groups.zeros).abs().max() * 2 ** -11
    assert (values - exact).abs().max() <= offset_error(weight, blocks) <= bound


def test_act_order_does_not_map_onto_blocks():
    _, tensors, scheme = _odd_groups("gptq-v1-act-order", k=128)
    assert "cut through blocks" in block_mapping_problem(read_int4(tensors, scheme, "act-order"))


@pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")
@pytest.mark.parametrize("rows, dtype", [(1, torch.float32), (5, torch.float32), (33, torch.float32),
                                         (3, torch.float16)])
@pytest.mark.parametrize("layout", ["awq", "gptq-v1-act-order"])
def test_int4_kernel_matches_dequantize_then_matmul(rows, dtype, layout):
    from kvpilot.model.quant.int4_triton import int4_matmul_into

    groups, tensors, scheme = _odd_groups(layout, n=40, k=96)  # 40 outputs, 96 inputs: tails in both
    weight = read_int4(tensors, scheme, layout).to(DEVICE)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype).to(DEVICE)
    wide = torch.zeros(rows, 50, dtype=dtype, device=DEVICE)  # the output as a column slice of a wider one
    int4_matmul_into(wide[:, 3:43], x, weight)
    # 16-bit activations multiply the weight tile rounded to their dtype, accumulating in float32
    expected = x.cpu().float() @ groups.dequantized().to(dtype).float().t()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(wide[:, 3:43].cpu().float(), expected, rtol=tol, atol=tol)
    assert not wide[:, :3].any() and not wide[:, 43:].any()


@pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")
@pytest.mark.parametrize("block", [(128, 128), (1, 200), (136, 200), (16, 64)])
def test_fp8_kernel_matches_dequantize_then_matmul(block):
    from kvpilot.model.quant.fp8_triton import fp8_matmul_into

    w = torch.randn(136, 200, generator=torch.Generator().manual_seed(1)) * 0.1
    q, scale, deq = fp8_quantize(w, block)
    weight = Fp8Weight(q, scale, block).to(DEVICE)
    x = torch.randn(7, 200, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out = torch.empty(7, 136, device=DEVICE)
    fp8_matmul_into(out, x, weight)
    torch.testing.assert_close(out.cpu(), x.cpu() @ deq.t(), rtol=1e-5, atol=1e-5)


def test_fp8_parts_fuse_along_the_outputs():
    """q/k/v of 128, 64, 64 rows with 128-row blocks: the fused scale goes per row; per-tensor parts per channel."""
    g = torch.Generator().manual_seed(3)
    parts, dense = [], []
    for rows in (128, 64, 64):
        q, scale, deq = fp8_quantize(torch.randn(rows, 256, generator=g), (128, 128))
        parts.append(read_fp8({"weight": q, "weight_scale_inv": scale}, Fp8Scheme("fp8", "weight_scale_inv",
                                                                                  (128, 128)), "part"))
        dense.append(deq)
    fused = Fp8Weight.concat(parts)
    assert fused.block == (1, 128) and torch.equal(fused.dequantize(), torch.cat(dense))
    tensor_parts = [Fp8Weight(p.weight, p.scale[:1, :1].clone(), (p.out_features, 256)) for p in parts]
    fused = Fp8Weight.concat(tensor_parts)
    assert fused.per_channel and torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in tensor_parts]))


def test_transformers_dequantizes_the_fp8_checkpoint_as_written(tmp_path):
    """The fp8 block checkpoint the test writes, loaded by transformers itself (it dequantizes fp8 on CPU): the
    same weights the packer's reference holds (AWQ, GPTQ and compressed-tensors need gptqmodel or
    compressed-tensors, not installed: for those the documented layouts are the reference)."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    model, path = _checkpoint(tmp_path, LLAMA, fp8_blocks())
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        ours = model.get_submodule(name).weight
        theirs = loaded.get_submodule(name)
        theirs = theirs.weight.to(torch.float32) * _expand(theirs.weight_scale_inv, ours.shape) \
            if hasattr(theirs, "weight_scale_inv") else theirs.weight
        assert torch.equal(theirs.to(torch.float32), ours)


def _expand(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]].to(torch.float32)


UNSUPPORTED = {
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "awq-gemv": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
    "gptq-8-bit": {"quant_method": "gptq", "bits": 8, "group_size": 128},
    "gptq-marlin": {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
    "fp8-e5m2": {"quant_method": "fp8", "fmt": "e5m2"},
    "compressed-int8": _compressed_config("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
                                          None),
    "compressed-nvfp4": _compressed_config("nvfp4-pack-quantized", {"num_bits": 4, "type": "float",
                                                                    "strategy": "tensor_group"}, None),
}


@pytest.mark.parametrize("variant", list(UNSUPPORTED))
def test_unsupported_variants_are_refused_naming_what_is(variant):
    with pytest.raises(ModelLoadError, match="is not supported; kvpilot loads awq .*compressed-tensors"):
        read_checkpoint_scheme({"quantization_config": UNSUPPORTED[variant]}, "ckpt")


def test_schemes_read_from_quantization_config():
    assert read_checkpoint_scheme({}, "plain") is None
    gptq_v1 = read_checkpoint_scheme({"quantization_config": gptq(128, sym=True).quantization_config}, "c")
    assert gptq_v1 == Int4Scheme("gptq", "gptq", 128, symmetric=True, zero_offset=1)
    assert read_checkpoint_scheme({"quantization_config": fp8_blocks().quantization_config}, "c") == \
        Fp8Scheme("fp8", "weight_scale_inv", (128, 128))
    assert read_checkpoint_scheme({"quantization_config": compressed_fp8("block").quantization_config}, "c") == \
        Fp8Scheme("compressed-tensors", "weight_scale", (128, 128))


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    """(transformers reference, directory) of one AWQ group-128 checkpoint shared by the tests below."""
    return _checkpoint(tmp_path_factory.mktemp("awq"), LLAMA, awq(128))


@pytest.mark.parametrize("flag, message", [
    ("int4", "pre-quantized awq checkpoint .* --quantization int4 contradicts it"),
    ("gptq", "--quantization gptq contradicts it"),
    ("gguf", "is not a GGUF file"),
])
def test_a_contradicting_quantization_flag_is_an_error(flag, message, awq_checkpoint):
    _, path = awq_checkpoint
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path), dtype="float32", device="cpu", quantization=flag)


def test_none_dequantizes_a_prequantized_checkpoint(awq_checkpoint):
    hf, path = awq_checkpoint
    llm = LLM(model=str(path), dtype="float32", device="cpu", quantization="none", kv_cache_memory="16MiB",
              max_model_len=256)
    assert llm.loaded.quantization == "none" and isinstance(llm.loaded.model.layers[1].mlp.down_proj,
                                                            torch.nn.Linear)
    _assert_decodes_like_hf(llm, hf, "awq under --quantization none")


def test_checkpoint_methods_need_a_prequantized_checkpoint(tmp_path):
    directory = tmp_path / "plain"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(ModelLoadError, match="has no quantization_config; use --quantization int4"):
        load_model(str(directory), dtype="float32", device="cpu", quantization="awq")
    with pytest.raises(ModelLoadError, match="reads pre-quantized HF checkpoints"):
        load_model(None, dtype="float32", device="cpu", quantization="gptq")
    with pytest.raises(ModelLoadError, match="reads pre-quantized HF checkpoints"):
        load_model("smollm2-135m", load_format="dummy", dtype="float32", device="cpu",
                   quantization="compressed-tensors")


def test_tensor_parallel_is_refused(awq_checkpoint):
    _, path = awq_checkpoint
    with pytest.raises(ModelLoadError, match="do not run with tensor parallelism"):
        load_model(str(path), dtype="float32", device="cpu", tp_rank=0, tp_size=2)
