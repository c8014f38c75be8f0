"""Gemma 2 and Gemma 3 (text) against HF transformers on tiny random-weight models with Gemma's real head
layout (head_dim 32 != hidden 64 / 4 heads, query_pre_attn_scalar != head_dim), 3 layers mixing sliding and
global attention with a window of 8 tokens, far shorter than the prompts:

- float32 greedy output token for token through LLM.generate: prompts batched together (continuous
  batching), a KV cache too small for all of them (preemption), a prompt sharing its first two blocks with an
  earlier one (prefix caching); from the safetensors directory, from a GGUF laid out as llama.cpp's converter
  writes one, and (Gemma 3) over two tensor-parallel ranks;
- bfloat16 logits within BF16_LOGIT_BOUND of HF's float32 ones.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.model.config import from_hf_config
from kvpilot.model.models.gemma2 import gemma_settings
from kvpilot.model.models.gemma3 import Gemma3RopeBases
from kvpilot.model.runner import ModelRunner
from tests.model.gemma_gguf import write_gemma_gguf
from tests.model.reference import hf_greedy

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 1024, "sliding_window": 8,
        "query_pre_attn_scalar": 24, "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1,
        "pad_token_id": 0, "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "float32"}
CONFIGS = {
    # even layers slide (transformers' Gemma 2 default); soft-caps low enough to bend these logits
    "gemma2": {**BASE, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 3,
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "rope_theta": 10000.0},
    # two sliding layers (local base 10,000) then a global one (base 1,000,000)
    "gemma3": {**BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 3,
               "sliding_window_pattern": 3, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0},
}
NEW_TOKENS = 16
# bf16 weights and activations against the float32 reference: the largest |logit difference| over the
# vocabulary at a 40-token prompt's last position, on logits of standard deviation 0.6 (measured: about 0.02
# for Gemma 2, whose final soft-cap of 3 compresses them, and 0.05 for Gemma 3)
BF16_LOGIT_BOUND = 0.1


def _prompts() -> list[list[int]]:
    long = [(i * 37 + 11) % 509 + 3 for i in range(40)]
    return [[5], [(i * 13 + 7) % 509 + 3 for i in range(7)], long, long[:32] + [17, 250, 3, 99, 4, 400, 8, 8, 61]]


def _save_random_hf_model(name: str, directory):
    """A transformers model of CONFIGS[name], every parameter random (the norms' zero-centred weights too,
    kept within (1 + w) in [0.5, 2], where the GGUF's stored 1 + w converts back exactly)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    (directory / "config.json").write_text(json.dumps(CONFIGS[name]))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            param.copy_((0.15 if "norm" in param_name else 0.08) * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """family -> (HF model, its directory, HF's greedy continuation of each of _prompts()), built once."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            model = _save_random_hf_model(name, directory)
            cache[name] = (model, directory, [hf_greedy(model, p, NEW_TOKENS) for p in _prompts()])
        return cache[name]

    return get


@pytest.fixture(params=sorted(CONFIGS))
def tiny(request, built):
    return (request.param, *built(request.param))


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_transformers_with_preemption_and_prefix_caching(tiny):
    name, _, directory, expected = tiny
    # three KV groups of one layer each (one full, two sliding): 2 KV heads x 32 x 2 x 4 bytes = 512 bytes a
    # token, 12 blocks of 16, what one request of 96 tokens holds at once in chunks of 16 (6 full-layer blocks,
    # 3 in each sliding group); the first three requests need more at once
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory="96KiB", max_model_len=96,
              max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.loaded.config.family == CONFIGS[name]["model_type"]
    assert llm.engine.scheduler.cache_config.group_windows == (None, 8, 8)
    prompts = _prompts()
    assert _generate(llm, prompts[:3]) == expected[:3]
    assert llm.engine.scheduler.make_stats().num_preemptions > 0
    shared = llm.generate(prompts[3:], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert shared.num_cached_tokens == 32  # prompts[2]'s first two blocks
    assert shared.outputs[0].token_ids == expected[3]


def test_piecewise_graph_steps_match_transformers(tiny):
    """The same run with every step replayed through the piecewise graphs' breakpoints (model/piecewise_graphs.py;
    on a CPU the pieces run eagerly over the same static buffers): attention between the pieces reads each KV
    group's metadata (Gemma 3's three groups), padding rows reach no cache, and the tokens stay HF's."""
    name, _, directory, expected = tiny
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory="96KiB", max_model_len=96,
              max_num_batched_tokens=16, max_num_seqs=4)
    runner = llm.engine.runner
    runner.capture_piecewise_graphs([4, 8, 16])
    buckets: list[tuple[int, int]] = []
    forward = runner.piecewise.forward
    runner.piecewise.forward = lambda ids, pos, attn, size: buckets.append((len(ids), size)) or \
        forward(ids, pos, attn, size)
    prompts = _prompts()
    assert _generate(llm, prompts[:3]) == expected[:3]
    assert llm.engine.scheduler.make_stats().num_preemptions > 0
    assert _generate(llm, prompts[3:]) == expected[3:]
    assert {size for _, size in buckets} == {4, 8, 16} and any(n < size for n, size in buckets)
    assert all(n <= size for n, size in buckets)


@contextmanager
def _attention_scaled_by_head_dim(model):
    """The HF model as llama.cpp runs its GGUF, which stores no query_pre_attn_scalar: scaled by head_dim**-0.5
    (by hidden / heads for the 27B models only)."""
    attentions = [layer.self_attn for layer in model.model.layers]
    saved = [a.scaling for a in attentions]
    for a in attentions:
        a.scaling = a.head_dim ** -0.5
    try:
        yield model
    finally:
        for a, scaling in zip(attentions, saved):
            a.scaling = scaling


def test_gguf_matches_transformers(tiny, tmp_path):
    name, model, _, _ = tiny
    path = tmp_path / f"{name}.gguf"
    write_gemma_gguf(model, path, name, sliding_window_pattern=3 if name == "gemma3" else None)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="1MiB", max_model_len=96)
    assert llm.loaded.config.layer_types == tuple(model.config.layer_types)
    prompts = _prompts()[::2]  # 1 and 40 tokens
    with _attention_scaled_by_head_dim(model):
        expected = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
    assert _generate(llm, prompts) == expected


def test_bf16_logits_stay_close_to_float32(tiny):
    _, model, directory, _ = tiny
    prompt = _prompts()[2]
    llm = LLM(model=str(directory), dtype="bfloat16", kv_cache_memory="1MiB", max_model_len=96)
    runner = ModelRunner(llm.loaded, num_blocks=8, block_size=16)
    new = NewRequestData("r", prompt, [], SamplingParams(), [0, 1, 2], 0)
    _, logits = runner.forward_logits(SchedulerOutput([ScheduledChunk("r", 0, len(prompt), True)],
                                                      new_requests=[new]))
    with torch.inference_mode():
        reference = model(torch.tensor([prompt])).logits[0, -1]
    assert (logits[0] - reference).abs().max().item() < BF16_LOGIT_BOUND


def test_ngram_speculation_over_kv_groups_matches_transformers(built):
    """Drafts written into every KV group's blocks, and the rejected ones' blocks trimmed from each table:
    still HF's tokens (a repetitive prompt, so n-gram drafts come and some are rejected)."""
    model, directory, _ = built("gemma2")
    prompt = [7, 8, 9, 10, 11] * 8
    expected = hf_greedy(model, prompt, NEW_TOKENS)
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory="1MiB", max_model_len=96,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert llm.engine.scheduler.cache_config.num_groups == 3
    (output,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert output.outputs[0].token_ids == expected and output.metrics.num_draft_tokens > 0


def test_two_tensor_parallel_ranks_match_transformers(built):
    """Gemma 3 (Gemma 2's layers plus the replicated q/k norms): each rank its heads and MLP share."""
    _, directory, expected = built("gemma3")
    llm = LLM(model=str(directory), dtype="float32", tensor_parallel_size=2, kv_cache_memory="1MiB",
              max_model_len=96)
    try:
        assert _generate(llm, _prompts()[:3]) == expected[:3]
    finally:
        llm.engine.runner.shutdown()


def test_config_defaults_follow_transformers():
    """Keys a config.json leaves out take transformers' defaults: Gemma 2 soft-caps at 50 (attention) and 30
    (logits), Gemma 3 not at all; query_pre_attn_scalar 256. A null cap is off. Gemma 3's RoPE bases come
    from either config layout (4.x flat keys, 5.x rope_parameters per layer type)."""
    bare = {k: v for k, v in CONFIGS["gemma2"].items() if "softcapping" not in k and k != "query_pre_attn_scalar"}
    settings = gemma_settings(from_hf_config(bare))
    assert (settings.attn_logit_softcapping, settings.final_logit_softcapping) == (50.0, 30.0)
    assert settings.query_pre_attn_scalar == 256
    assert gemma_settings(from_hf_config({**bare, "attn_logit_softcapping": None})).attn_logit_softcapping is None
    gemma3 = {k: v for k, v in CONFIGS["gemma3"].items() if not k.startswith("rope")}
    assert gemma_settings(from_hf_config(gemma3)).final_logit_softcapping is None
    assert Gemma3RopeBases.from_config(from_hf_config(gemma3)) == Gemma3RopeBases(1e6, 1e4)
    flat = from_hf_config({**gemma3, "rope_theta": 2e5, "rope_local_base_freq": 7e3})
    by_type = {"full_attention": {"rope_type": "default", "rope_theta": 2e5},
               "sliding_attention": {"rope_type": "default", "rope_theta": 7e3}}
    nested = from_hf_config({**gemma3, "rope_parameters": by_type})
    assert Gemma3RopeBases.from_config(flat) == Gemma3RopeBases.from_config(nested) == Gemma3RopeBases(2e5, 7e3)
    assert nested.rope_theta == 2e5  # the global layers' base is the config's


@pytest.mark.parametrize("arch, layers, scalar", [("gemma2", 46, 144), ("gemma2", 42, 128), ("gemma3", 62, 144)])
def test_gguf_attention_scale_follows_llama_cpp(tmp_path, arch, layers, scalar):
    """The GGUF has no query_pre_attn_scalar: llama.cpp scales the 27B models (46 layers for Gemma 2, 62 for
    Gemma 3) by hidden / heads and the others by head_dim; a missing soft-cap key keeps the family default."""
    from gguf import GGUFWriter

    from kvpilot.fit.gguf_metadata import hf_config_from_gguf

    path = tmp_path / "header.gguf"
    writer = GGUFWriter(str(path), arch)
    for add, value in [(writer.add_block_count, layers), (writer.add_embedding_length, 4608),
                       (writer.add_feed_forward_length, 36864), (writer.add_head_count, 32),
                       (writer.add_head_count_kv, 16), (writer.add_key_length, 128), (writer.add_vocab_size, 256),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_sliding_window, 4096)]:
        add(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    config = from_hf_config(hf_config_from_gguf(path), str(path))
    settings = gemma_settings(config)
    assert settings.query_pre_attn_scalar == scalar
    assert settings.attn_logit_softcapping == (50.0 if arch == "gemma2" else None)
    assert config.layer_types[:6] == (("sliding_attention", "full_attention") * 3 if arch == "gemma2"
                                      else ("sliding_attention",) * 5 + ("full_attention",))
