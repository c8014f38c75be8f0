"""gpt-oss: a tiny random model (3 layers sliding / full / sliding with an 8-token window, 8 experts top-2, sinks,
YaRN) against transformers token for token in float32 through LLM.generate (continuous batching, the prefix
cache, preemption), from save_pretrained's dequantized layout, from an MXFP4 checkpoint as OpenAI ships them and
from llama.cpp's GGUF (MXFP4 experts);
the MXFP4 dequantizer against transformers' own; the router and the clamped SwiGLU against transformers'
modules; the Triton experts with biases (interpreter on CPU); bf16 logits within a stated bound."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvpilot import LLM
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.layers.moe import grouped_experts
from kvpilot.model.layers.moe_variants import ClampedSwiGLU, route_top_k_softmax
from kvpilot.model.loader import load_model
from kvpilot.model.models.gpt_oss_weights import deinterleave, dequantize_mxfp4
from kvpilot.model.quant.packed_experts import PackedExperts
from tests.model.gpt_oss_gguf import round_experts_to_mxfp4, write_gpt_oss_gguf
from tests.model.hf_match import (HfGreedy, assert_batch_matches, assert_prefix_hit_matches,
                                  assert_preempted_matches, prompt_ids)
from tests.model.test_fp8 import _logits
from tests.model.triton_cases import ON_GPU, TRITON_SKIP_REASON

VOCAB, NEW_TOKENS = 512, 12
# gpt-oss-20b's config.json at a tiny size: real head layout (q heads 4 x kv heads 2, head_dim 16), an 8-token
# window shorter than most prompts, YaRN as released (truncate false); swiglu_limit 1.5 (7.0 released) so that
# the clamps bite on these random weights
CONFIG = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
          "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "vocab_size": VOCAB, "num_local_experts": 8, "num_experts_per_tok": 2,
          "experts_per_token": 2, "sliding_window": 8,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "rope_theta": 150000,
          "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 128},
          "max_position_embeddings": 4096, "attention_bias": True, "rms_norm_eps": 1e-5, "swiglu_limit": 1.5,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
# random weights whose outputs vary from token to token: strong sinks and embeddings, weak biases (strong ones
# make every position's hidden state alike, and the greedy outputs one token over and over)
STDS = {"norm": 0.1, "bias": 0.02, "sinks": 1.0, "embed": 1.0, "experts": 0.15}
KV_BYTES_PER_TOKEN = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x float32


def _random_hf_model(cfg: dict, directory: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = next((value for key, value in STDS.items() if key in name), 0.12)
            param.copy_((1.0 if "norm" in name else 0.0) + std * torch.randn(param.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[HfGreedy, Path]:
    """(HF's greedy decoder, its save_pretrained directory: gate_up_proj [E, H, 2I] and friends)."""
    path = tmp_path_factory.mktemp("gpt-oss")
    model = _random_hf_model(CONFIG, path)
    model.save_pretrained(path, safe_serialization=True)
    return HfGreedy(model), path


def test_generate_matches_transformers(saved):
    hf, path = saved
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="4MiB", max_model_len=256)
    config = llm.loaded.config
    windows = [config.layer_window(i) for i in range(3)]
    assert (config.family, config.num_experts, windows) == ("gpt_oss", 8, [8, None, 8])
    assert config.rope_scaling.rope_type == "yarn" and not config.rope_scaling.truncate
    prompts = prompt_ids([1, 9, 40, 120], VOCAB)
    assert_batch_matches(llm, hf, prompts, NEW_TOKENS, "gpt-oss batch")
    shared = prompt_ids([40], VOCAB, seed=5)[0]  # two 16-token blocks shared, read from the prefix cache
    tails = [[7, 8, 9], [100, 200]]
    assert_prefix_hit_matches(llm, hf, shared, tails, NEW_TOKENS, "gpt-oss prefix")
    # three KV groups of one layer each (sliding, full, sliding): 16 blocks of 16 tokens of one layer, what one
    # request of 160 tokens holds at once in chunks of 16 (10 full-layer blocks, 3 in each sliding group)
    small = assert_preempted_matches(llm, hf, prompts + [shared + tail for tail in tails], NEW_TOKENS,
                                     f"{16 * 16 * KV_BYTES_PER_TOKEN // 3}B", 160, "gpt-oss preemption",
                                     max_num_batched_tokens=16, max_num_seqs=4)
    assert small.engine.scheduler.cache_config.group_windows == (None, 8, 8)


def _pack_mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [..., G, 16] and scales [..., G] for `shape` [..., rows, G * 32]: every code, scales
    2**-6 .. 2**-3 (weights of the size the float32 model has)."""
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(127 - 6, 127 - 2, (*lead, cols // 32), dtype=torch.uint8, generator=generator)
    return blocks, scales


def _packed_then_dequantized(path: Path, caplog, dequantized_warning: str) -> Iterator[tuple[str, LLM]]:
    """(quantization, LLM of `path`) for --quantization auto, its experts kept packed on this CPU, then none, its
    experts dequantized with `dequantized_warning` logged (both checked before each is yielded)."""
    for quantization in ("auto", "none"):
        caplog.clear()
        with caplog.at_level("WARNING"):
            llm = LLM(model=str(path), dtype="float32", kv_cache_memory="4MiB", max_model_len=256,
                      quantization=quantization)
        experts = llm.engine.runner.model.layers[1].mlp.experts
        assert isinstance(experts, PackedExperts) == (quantization == "auto"), type(experts)
        assert (dequantized_warning in caplog.text) == (quantization == "none")
        yield quantization, llm


def test_mxfp4_checkpoint_matches_transformers(saved, tmp_path, caplog):
    """OpenAI's layout: *_blocks / *_scales experts beside a quantization_config, kept packed on CPU or dequantized.
    transformers' own dequantizer gives the reference model (a copy of the saved one) its expert weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = copy.deepcopy(saved[0].model)
    state, generator = {}, torch.Generator().manual_seed(1)
    hidden, inter = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                state[name] = tensor.contiguous()
                continue
            rows = 2 * inter if name.endswith("gate_up_proj") else hidden  # stored [E, out, in]
            blocks, scales = _pack_mxfp4((8, rows, tensor.shape[1]), generator)
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
            tensor.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))  # [E, in, out]
    path = tmp_path / "mxfp4"
    path.mkdir()
    save_file(state, str(path / "model.safetensors"))
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                 "model.layers.*.mlp.router", "model.embed_tokens",
                                                                 "lm_head"]}
    (path / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": quant}))
    for quantization, llm in _packed_then_dequantized(path, caplog, "MXFP4 experts dequantized to float32"):
        assert_batch_matches(llm, HfGreedy(model), prompt_ids([9, 40], VOCAB, seed=3), NEW_TOKENS,
                             f"gpt-oss mxfp4, quantization {quantization}")
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing MXFP4 expert tensors \['layers\.1\.mlp\.experts\.down_proj_s"):
        load_model(str(path), dtype="float32", device="cpu")


def test_gguf_matches_transformers(tmp_path, caplog):
    """llama.cpp's `gpt-oss` GGUF of the tiny model, its experts in MXFP4 blocks as the released GGUFs keep them:
    the config comes from the metadata (alternating windows, YaRN untruncated, the SwiGLU clamp at llama.cpp's
    fixed 7.0, which the file cannot carry), the tensors from llama.cpp's names and split gate/up. The experts
    stay packed on CPU (biases and clamped SwiGLU on the float32 kernel), or with --quantization none are
    dequantized, with the warning naming the cost; both decode as transformers does."""
    model = _random_hf_model({**CONFIG, "swiglu_limit": 7.0}, tmp_path / "hf")
    round_experts_to_mxfp4(model)
    path = tmp_path / "model.gguf"
    write_gpt_oss_gguf(model, path, "MXFP4")
    hf, prompts = HfGreedy(model), prompt_ids([1, 9, 40], VOCAB, seed=4)
    for quantization, llm in _packed_then_dequantized(path, caplog, "MXFP4 tensors are dequantized at load"):
        config = llm.loaded.config
        assert (config.family, config.num_experts, [config.layer_window(i) for i in range(3)]) == (
            "gpt_oss", 8, [8, None, 8])
        assert config.rope_scaling.rope_type == "yarn" and not config.rope_scaling.truncate
        assert_batch_matches(llm, hf, prompts, NEW_TOKENS, f"gpt-oss gguf, quantization {quantization}")


def test_mxfp4_dequantizer_matches_transformers_and_a_hand_packed_block():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (2, 6, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.arange(0, 255, dtype=torch.int32)[torch.randperm(255, generator=generator)[:48]]
    scales = scales.to(torch.uint8).view(2, 6, 4)  # every scale but 255 (E8M0's NaN)
    for dtype in (torch.float32, torch.bfloat16):
        expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)  # back to [E, out, in]
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), expected)
    # byte 0x9F: low nibble 0xF (-6.0) first, high nibble 0x9 (-0.5); byte 0x72: 1.0, then 6.0; scale 2**1
    block = torch.tensor([[0x9F, 0x72] + [0] * 14], dtype=torch.uint8)
    values = dequantize_mxfp4(block, torch.tensor([128], dtype=torch.uint8), torch.float32)
    assert values.shape == (32,) and values[:4].tolist() == [-12.0, -1.0, 2.0, 12.0] and not values[4:].any()


def test_router_and_activation_match_transformers():
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    config = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                          swiglu_limit=1.5)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(13, 64, generator=generator)
    router = GptOssTopKRouter(config)
    with torch.no_grad():
        router.weight.normal_(generator=generator)
        router.bias.normal_(generator=generator)
        _, weights, ids = router(x)
        ours = route_top_k_softmax(torch.nn.functional.linear(x, router.weight, router.bias), 2)
    assert torch.equal(ours[1], ids) and torch.equal(ours[0], weights)
    gate_up = 3 * torch.randn(13, 64, generator=generator)  # interleaved, as transformers holds it
    expected = GptOssExperts(config)._apply_gate(gate_up)
    assert (gate_up.abs() > 1.5).any()  # the clamps bite
    assert torch.equal(ClampedSwiGLU(limit=1.5)(deinterleave(gate_up, 1)), expected)


@pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else []))
@pytest.mark.parametrize("num_tokens", [1, 70])
def test_triton_experts_with_biases_match_the_grouped_path(num_tokens, dtype):
    """The CUDA path of gpt-oss's experts (bf16 only compiled: see test_triton_moe.py)."""
    from kvpilot.model.layers import triton_moe

    device = torch.device("cuda" if ON_GPU else "cpu")
    generator = torch.Generator().manual_seed(num_tokens)
    hidden, inter, experts = 96, 80, 8  # neither a multiple of the 64-wide tiles
    tensors = [torch.randn(num_tokens, hidden, generator=generator),
               torch.randn(experts, 2 * inter, hidden, generator=generator) * 0.2,
               torch.randn(experts, hidden, inter, generator=generator) * 0.2,
               torch.randn(experts, 2 * inter, generator=generator), torch.randn(experts, hidden, generator=generator)]
    x, gate_up, down, gate_up_bias, down_bias = (t.to(dtype).float() for t in tensors)
    weights, ids = route_top_k_softmax(torch.randn(num_tokens, experts, generator=generator), 2)
    swiglu = ClampedSwiGLU(limit=1.5)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return swiglu(rows @ gate_up[e].T + gate_up_bias[e]) @ down[e].T + down_bias[e]

    expected = grouped_experts(x, weights, ids, experts, expert)
    x, gate_up, down, gate_up_bias, down_bias = (t.to(device, dtype) for t in (x, gate_up, down, gate_up_bias,
                                                                              down_bias))
    out = triton_moe.fused_experts(x, gate_up, down, weights.to(device), ids.to(device), gate_up_bias=gate_up_bias,
                                   down_bias=down_bias, activation=swiglu)
    assert out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.cpu().float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_tokens", [1, 30])
def test_bf16_logits_stay_near_float32(saved, num_tokens):
    hf, path = saved
    loaded = load_model(str(path), dtype="bfloat16", device="cpu", max_model_len=64)
    ids = torch.tensor(prompt_ids([num_tokens], VOCAB, seed=11)[0])
    logits = _logits(loaded.model, ids).float()
    with torch.no_grad():
        expected = hf.model(ids[None]).logits[0].float()
    error = ((logits - expected).norm() / expected.norm()).item()
    # bf16 weights and activations, the router's top 2 of near-tied experts routed either way: measured below
    # 0.02 on these weights
    assert error < 0.05
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_config_without_a_window_is_a_load_error(tmp_path):
    cfg = {key: value for key, value in CONFIG.items() if key != "sliding_window"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="a gpt-oss config needs sliding_window"):
        load_model(str(tmp_path), load_format="dummy", dtype="float32", device="cpu")
