"""Continuous batching on the real model: batched greedy outputs are token-identical to each prompt run alone,
whatever the batch, the token budget (chunked prefill), the prefix cache, or preemption does."""

from __future__ import annotations

import pytest

from kvpilot import LLM, SamplingParams
from tests.engine_e2e.conftest import GREEDY, assert_no_leak, generate_with_steps, prefix_waves

pytestmark = pytest.mark.slow


def test_32_concurrent_mixed_lengths(llm_fp32, mixed_prompts, mixed_alone):
    llm = LLM(loaded=llm_fp32.loaded, enable_prefix_caching=False, kv_cache_memory="256MiB", max_model_len=2048)
    outputs, steps = generate_with_steps(llm, mixed_prompts)
    assert [o.outputs[0].token_ids for o in outputs] == mixed_alone
    assert max(s.num_scheduled_seqs for s in steps) == 32  # all 32 really ran in one batch
    assert_no_leak(llm)


# chunking and preemption on the first 16 prompts (1 to 200 tokens, 965 in all: 16 chunks of 64 at least, and
# twice what 26MiB of KV holds): all 32 in one batch is test_32_concurrent_mixed_lengths's proof
def test_chunked_prefill_with_small_budget(llm_fp32, mixed_prompts, mixed_alone):
    llm = LLM(loaded=llm_fp32.loaded, enable_prefix_caching=False, kv_cache_memory="256MiB", max_model_len=2048,
              max_num_batched_tokens=64, max_num_seqs=16)
    outputs, steps = generate_with_steps(llm, mixed_prompts[:16])
    assert [o.outputs[0].token_ids for o in outputs] == mixed_alone[:16]
    assert max(s.num_batched_tokens for s in steps) == 64
    assert any(s.num_decode_tokens and s.num_prefill_tokens for s in steps)  # decodes ran beside prefill chunks
    assert_no_leak(llm)


def test_second_wave_hits_the_prefix_cache(llm_fp32, corpus_ids, second_wave_alone):
    first, second = prefix_waves(corpus_ids)
    llm = LLM(loaded=llm_fp32.loaded, kv_cache_memory="256MiB", max_model_len=2048)
    llm.generate(first, GREEDY)
    outputs = llm.generate(second, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == second_wave_alone
    assert [o.num_cached_tokens for o in outputs] == [144] * 5  # all 9 full blocks of the shared prefix
    assert all(o.metrics.num_cached_tokens == 144 for o in outputs)
    stats = llm.engine.scheduler.make_stats()
    assert stats.prefix_cache_hits >= 5 * 144
    assert_no_leak(llm)


def test_preemption_under_kv_pressure(llm_fp32, mixed_prompts, mixed_alone):
    # fp32 KV is 46,080 bytes per token: 26MiB holds ~590 tokens, under half of what these 16 need at once (1,221)
    llm = LLM(loaded=llm_fp32.loaded, enable_prefix_caching=False, kv_cache_memory="26MiB", max_model_len=512)
    outputs = llm.generate(mixed_prompts[:16], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == mixed_alone[:16]
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.engine.scheduler.make_stats().num_preemptions > 0
    assert_no_leak(llm)


def test_seeded_sampling_is_reproducible_across_batches(llm_fp32, mixed_prompts):
    llm = LLM(loaded=llm_fp32.loaded, kv_cache_memory="256MiB", max_model_len=2048)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([mixed_prompts[5]], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(mixed_prompts[:5] + [mixed_prompts[5]] + mixed_prompts[6:9], [others] * 5 + [seeded] + [others] * 3)
    assert batch[5].outputs[0].token_ids == alone
    again = llm.generate([mixed_prompts[1], mixed_prompts[5]], [others, seeded])
    assert again[1].outputs[0].token_ids == alone
